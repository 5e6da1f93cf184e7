//! The agent layer's errors, each saying what is wrong and how to fix it; the gateway turns
//! each kind into its HTTP status in the API's own error shape.

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The tokenizer files cannot be read or loaded.
    #[error("{0}")]
    Tokenizer(String),
    /// The chat template does not compile.
    #[error("{0}")]
    Template(String),
    /// A setting is wrong (an unknown parser name).
    #[error("{0}")]
    Config(String),
    /// The request is wrong (400).
    #[error("{0}")]
    BadRequest(String),
    /// No such session (404).
    #[error("{0}")]
    NotFound(String),
    /// The session is gone (410, AReaL's answer for an ended or expired session).
    #[error("{0}")]
    Gone(String),
    /// It clashes with what is open (409).
    #[error("{0}")]
    Conflict(String),
    /// A cap is reached (429).
    #[error("{0}")]
    Full(String),
    /// The sessions' store on disk cannot be written or read (503: nothing was recorded).
    #[error("{0}")]
    Storage(String),
}

impl AgentError {
    /// The HTTP status the gateway answers with.
    pub fn status(&self) -> u16 {
        match self {
            Self::Tokenizer(_) | Self::Template(_) | Self::Config(_) => 500,
            Self::BadRequest(_) => 400,
            Self::NotFound(_) => 404,
            Self::Gone(_) => 410,
            Self::Conflict(_) => 409,
            Self::Full(_) => 429,
            Self::Storage(_) => 503,
        }
    }
}
