//! A header value as decoding reads it (text, or milliseconds in any width a producer
//! sends) and as every refusal names it: in the producer's terms, never Rust's.

use lapin::types::AMQPValue;

use super::{invalid, Invalid};
use crate::job::float_millis;

/// Milliseconds from an integer of any AMQP width, a finite float (rounded up: a job
/// is never due early), or a numeric string; with the value as the user wrote it, for
/// messages. The range is checked by
/// [`crate::job::Due::delay`] / [`crate::job::Due::at`].
pub(super) fn millis(value: &AMQPValue, name: &str) -> Result<(i128, String), Invalid> {
    let bad = || {
        invalid(format!(
            "{name} must be an integer number of milliseconds (or a numeric string), got {}",
            show(value)
        ))
    };
    let int = |v: i64| Ok((i128::from(v), v.to_string()));
    match value {
        AMQPValue::ShortShortInt(v) => int(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => int(i64::from(*v)),
        AMQPValue::ShortInt(v) => int(i64::from(*v)),
        AMQPValue::ShortUInt(v) => int(i64::from(*v)),
        AMQPValue::LongInt(v) => int(i64::from(*v)),
        AMQPValue::LongUInt(v) => int(i64::from(*v)),
        AMQPValue::LongLongInt(v) => int(*v),
        // Debug keeps a float short as written (`1e300`, `2.5`).
        AMQPValue::Float(v) => Ok((
            float_millis(f64::from(*v)).ok_or_else(bad)?,
            format!("{v:?}"),
        )),
        AMQPValue::Double(v) => Ok((float_millis(*v).ok_or_else(bad)?, format!("{v:?}"))),
        AMQPValue::ShortString(_) | AMQPValue::LongString(_) => {
            let s = text(value).ok_or_else(bad)?;
            let s = s.trim();
            let ms = match s.parse::<i128>() {
                Ok(v) => v,
                Err(_) => s
                    .parse::<f64>()
                    .ok()
                    .and_then(float_millis)
                    .ok_or_else(bad)?,
            };
            Ok((ms, s.to_string()))
        }
        _ => Err(bad()),
    }
}

pub(super) fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// A non-string header value as a producer would name it (never the Rust debug form).
fn show_typed(value: &AMQPValue) -> String {
    match value {
        AMQPValue::Boolean(v) => format!("the boolean {v}"),
        AMQPValue::ShortShortInt(v) => v.to_string(),
        AMQPValue::ShortShortUInt(v) => v.to_string(),
        AMQPValue::ShortInt(v) => v.to_string(),
        AMQPValue::ShortUInt(v) => v.to_string(),
        AMQPValue::LongInt(v) => v.to_string(),
        AMQPValue::LongUInt(v) => v.to_string(),
        AMQPValue::LongLongInt(v) => v.to_string(),
        AMQPValue::Float(v) => format!("{v:?}"),
        AMQPValue::Double(v) => format!("{v:?}"),
        AMQPValue::DecimalValue(d) => format!("a decimal ({} with scale {})", d.value, d.scale),
        AMQPValue::Timestamp(v) => format!("the timestamp {v}"),
        AMQPValue::FieldArray(a) => format!("an array of {}", a.as_slice().len()),
        AMQPValue::FieldTable(t) => format!("a table of {}", t.inner().len()),
        AMQPValue::ByteArray(b) => format!("a byte array of {}", b.as_slice().len()),
        AMQPValue::Void => "an empty value".to_string(),
        AMQPValue::ShortString(s) => format!("{:?}", s.as_str()),
        AMQPValue::LongString(s) => format!("a {}-byte string", s.as_bytes().len()),
    }
}

/// A short, printable rendering of a header value for error messages.
pub(super) fn show(value: &AMQPValue) -> String {
    let shown = match (text(value), value) {
        (Some(s), _) => format!("{s:?}"),
        // A string that is not UTF-8.
        (None, AMQPValue::LongString(s)) => format!("a {}-byte binary string", s.as_bytes().len()),
        (None, other) => show_typed(other),
    };
    if shown.len() > 80 {
        let cut = (0..=80)
            .rev()
            .find(|&i| shown.is_char_boundary(i))
            .unwrap_or(0);
        format!("{}…", &shown[..cut])
    } else {
        shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::LongString;

    #[test]
    fn values_are_named_in_the_producers_terms_and_kept_short() {
        assert_eq!(
            show(&AMQPValue::LongString(LongString::from("soon"))),
            "\"soon\""
        );
        assert_eq!(show(&AMQPValue::Boolean(true)), "the boolean true");
        assert_eq!(show(&AMQPValue::Double(2.5)), "2.5");
        let binary = AMQPValue::LongString(LongString::from(vec![0xff, 0xfe]));
        assert_eq!(show(&binary), "a 2-byte binary string");
        let long = AMQPValue::LongString(LongString::from("é".repeat(100)));
        let shown = show(&long);
        assert!(
            shown.ends_with('…') && shown.len() <= 80 + '…'.len_utf8(),
            "{shown}"
        );
    }

    #[test]
    fn millis_in_every_width_float_and_text() {
        assert_eq!(
            millis(&AMQPValue::ShortShortInt(-3), "x"),
            Ok((-3, "-3".into()))
        );
        assert_eq!(millis(&AMQPValue::LongLongInt(7), "x"), Ok((7, "7".into())));
        assert_eq!(
            millis(&AMQPValue::Double(1.2), "x"),
            Ok((2, "1.2".into())),
            "rounded up"
        );
        let text = AMQPValue::LongString(LongString::from(" 2.5 "));
        assert_eq!(millis(&text, "x"), Ok((3, "2.5".into())));
        let err = millis(&AMQPValue::Boolean(true), "x-delay").expect_err("a boolean");
        assert!(err.0.starts_with("x-delay must be an integer"), "{err}");
    }
}
