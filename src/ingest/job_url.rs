//! The SSRF guard at the door: a command naming its own URL (`x-redisched-url`) is
//! valid only for a topic a webhook target serves, and only under one of that target's
//! `allowed_url_prefixes`. Anything else is set aside with the reason, as every invalid
//! command is.

use lapin::BasicProperties;

use super::decode::{Decoded, Invalid};
use crate::amqp::headers;
use crate::store::Op;
use crate::targets::{check_job_url_for, TargetConfig};

/// Checks a decoded put's own URL, if it names one; deletes pass.
pub(super) fn check(
    decoded: Decoded,
    props: &BasicProperties,
    targets: &[TargetConfig],
) -> Result<Decoded, Invalid> {
    let Op::Put(put) = decoded.op() else {
        return Ok(decoded);
    };
    let Some(value) = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::URL))
    else {
        return Ok(decoded);
    };
    let url = match value {
        lapin::types::AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .map_err(|_| Invalid(format!("{} is not UTF-8 text", headers::URL)))?
            .to_owned(),
        lapin::types::AMQPValue::ShortString(s) => s.as_str().to_owned(),
        _ => return Err(Invalid(format!("{} must be a text header", headers::URL))),
    };
    check_job_url_for(targets, put.topic.as_str(), &url)
        .map_err(|reason| Invalid(format!("{}: {reason}", headers::URL)))?;
    Ok(decoded)
}
