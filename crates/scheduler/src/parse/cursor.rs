//! A character cursor over the mode string: whitespace skipping, identifiers, numbers, and
//! errors that know their column.

use crate::error::SchedulerError;

/// Reads the mode string left to right; cheap to save and restore for lookahead.
pub(crate) struct Cursor<'a> {
    input: &'a str,
    chars: Vec<char>,
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(input: &'a str) -> Self {
        Cursor {
            input,
            chars: input.chars().collect(),
            pos: 0,
        }
    }

    /// The whole input, for messages.
    pub(crate) fn input(&self) -> &'a str {
        self.input
    }

    /// Current position (a char index), for save/restore.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Restores a saved position.
    pub(crate) fn set_pos(&mut self, pos: usize) {
        self.pos = pos.min(self.chars.len());
    }

    fn skip_ws(&mut self) {
        while self.chars.get(self.pos).is_some_and(|c| c.is_whitespace()) {
            self.pos += 1;
        }
    }

    /// The next non-whitespace char, without consuming it.
    pub(crate) fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.chars.get(self.pos).copied()
    }

    /// The char at a position, if any (no whitespace skipping).
    pub(crate) fn char_at(&self, pos: usize) -> Option<char> {
        self.chars.get(pos).copied()
    }

    /// Consumes `c` if it is next (after whitespace).
    pub(crate) fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Consumes and returns the next char (after whitespace).
    pub(crate) fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += 1;
        Some(c)
    }

    /// Whether only whitespace is left.
    pub(crate) fn at_end(&mut self) -> bool {
        self.peek().is_none()
    }

    /// Reads an identifier `[A-Za-z_][A-Za-z0-9_]*`, or nothing.
    pub(crate) fn ident(&mut self) -> Option<String> {
        let first = self.peek()?;
        if !(first.is_ascii_alphabetic() || first == '_') {
            return None;
        }
        let start = self.pos;
        while self
            .chars
            .get(self.pos)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
        {
            self.pos += 1;
        }
        Some(self.chars[start..self.pos].iter().collect())
    }

    /// Reads a run of ASCII digits right at the cursor (possibly empty).
    pub(crate) fn digits(&mut self) -> String {
        let start = self.pos;
        while self.chars.get(self.pos).is_some_and(char::is_ascii_digit) {
            self.pos += 1;
        }
        self.chars[start..self.pos].iter().collect()
    }

    /// The input with chars `start..end` replaced by `with`: builds corrected examples.
    pub(crate) fn splice(&self, start: usize, end: usize, with: &str) -> String {
        let end = end.min(self.chars.len());
        let start = start.min(end);
        let mut out: String = self.chars[..start].iter().collect();
        out.push_str(with);
        out.extend(self.chars[end..].iter());
        out
    }

    /// A description of what is at the cursor, for "found …" messages.
    pub(crate) fn found(&mut self) -> String {
        match self.peek() {
            None => "the end of the mode".to_string(),
            Some(c) => format!("`{c}`"),
        }
    }

    /// A syntax error at the current position.
    pub(crate) fn error(
        &mut self,
        message: impl Into<String>,
        example: impl Into<String>,
    ) -> SchedulerError {
        self.skip_ws();
        self.error_at(self.pos, message, example)
    }

    /// A syntax error at a saved position.
    pub(crate) fn error_at(
        &self,
        pos: usize,
        message: impl Into<String>,
        example: impl Into<String>,
    ) -> SchedulerError {
        SchedulerError::Syntax {
            input: self.input.to_string(),
            column: pos + 1,
            message: message.into(),
            example: example.into(),
        }
    }
}
