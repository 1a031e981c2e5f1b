//! JSON errors: `{"error": "<message>"}` (plus a machine-readable `code` where one
//! exists) with the status that fits.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::store::{RejectCode, StoreError};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            code: Some(RejectCode::BodyTooLarge.as_str()),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body is larger than limits.max_body_bytes ({limit} bytes)"),
            )
        }
    }

    /// A due time further from now than `limits.max_delay_ms`, found before the store
    /// was asked (same status and code as the store's refusal).
    pub fn delay_too_long(message: impl Into<String>) -> Self {
        Self {
            code: Some(RejectCode::DelayTooLong.as_str()),
            ..Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
        }
    }

    /// A job URL the configuration does not allow (no webhook target for the topic, or
    /// not under its `allowed_url_prefixes`): well-formed, refused by the SSRF rule.
    pub fn url_not_allowed(message: impl Into<String>) -> Self {
        Self {
            code: Some("url_not_allowed"),
            ..Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
        }
    }

    /// A schedule (`every`, `cron`, `tz`, `jitter`) in the form the document states that
    /// the server cannot use: an interval out of bounds, a cron field out of range or an
    /// expression that never fires, an unknown zone, a jitter not below the interval.
    pub fn invalid_schedule(message: impl Into<String>) -> Self {
        Self {
            code: Some("invalid_schedule"),
            ..Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
        }
    }

    /// The outcome label for `redisched_commands` and the event feed.
    pub fn outcome(&self) -> &'static str {
        match self.status {
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            StatusCode::INTERNAL_SERVER_ERROR => "error",
            _ => "invalid",
        }
    }
}

impl From<crate::job::DueError> for ApiError {
    fn from(err: crate::job::DueError) -> Self {
        Self::bad_request(err.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match &err {
            StoreError::Unavailable(_) | StoreError::NotReplicated { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
            }
            StoreError::Rejected(rejection) => {
                let status = match rejection.code {
                    RejectCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                    _ => StatusCode::UNPROCESSABLE_ENTITY,
                };
                Self {
                    code: Some(rejection.code.as_str()),
                    ..Self::new(status, format!("refused by the store: {rejection}"))
                }
            }
            StoreError::BadReply { .. } => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, err.to_string())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match self.code {
            Some(code) => json!({ "error": self.message, "code": code }),
            None => json!({ "error": self.message }),
        };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"redisched\""),
            );
        }
        response
    }
}

/// [`axum::extract::Path`] whose rejection (a segment that is not UTF-8 after
/// percent-decoding, …) is a JSON [`ApiError`] (400) like every other error, not
/// axum's plain-text answer.
pub(super) struct PathParams<T>(pub T);

impl<T, S> axum::extract::FromRequestParts<S> for PathParams<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| Self(value))
            .map_err(|rejection| ApiError::bad_request(rejection.body_text()))
    }
}
