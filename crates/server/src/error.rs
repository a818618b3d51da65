//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status clients key on (the `openai` package picks its exception class from the status).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::backend::{AdapterError, SubmitError};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    /// A 400 about one request field; the message names it.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param.to_string()) }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    pub fn model_not_found(model: &str) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, message: format!("The model `{model}` does not exist."), param: Some("model".into()) }
    }
    pub fn unavailable() -> Self {
        Self::unavailable_msg("The server is shutting down and accepts no new requests.")
    }
    pub fn unavailable_msg(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn error_type(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 413 | 422 => "BadRequestError",
            401 => "AuthenticationError",
            404 => "NotFoundError",
            409 => "ConflictError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.error_type(), "param": self.param, "code": self.status.as_u16()}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

/// Seconds a client should wait before retrying a 429 (queue full, adapter busy) or a 503
/// (shutting down: by then another replica, or this one restarted).
const RETRY_AFTER_SECS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if matches!(self.status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static(RETRY_AFTER_SECS));
        }
        r
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match &e {
            SubmitError::QueueFull => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
            SubmitError::UnknownAdapter(name) => ApiError::model_not_found(name),
            SubmitError::TooLong { .. } => ApiError::field("max_tokens", e.to_string()),
            SubmitError::Invalid(_) => ApiError::bad_request(e.to_string()),
            SubmitError::InvalidConstraint(_) => ApiError::bad_request(format!("invalid structured-output constraint: {e}")),
            SubmitError::ShuttingDown => ApiError::unavailable(),
        }
    }
}

impl From<AdapterError> for ApiError {
    fn from(e: AdapterError) -> Self {
        match &e {
            AdapterError::AlreadyLoaded(_) => ApiError::field("lora_name", e.to_string()),
            AdapterError::VersionMismatch { .. } => ApiError { status: StatusCode::CONFLICT, message: e.to_string(), param: Some("expected_version".into()) },
            AdapterError::NotFound(_) => ApiError::not_found(e.to_string()),
            AdapterError::Busy(_) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
            AdapterError::ShuttingDown => ApiError::unavailable(),
            AdapterError::Invalid(_) => ApiError::bad_request(e.to_string()),
        }
    }
}
