//! Parallel dimensions: `<letter><positive int>` in any order, the last repeat wins.

use super::cursor::Cursor;
use crate::error::SchedulerError;

/// Dimensions as written; `None` where a letter was not given (the hybrid `ffn` section derives
/// its `d` when omitted, so "absent" differs from "1").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dims {
    pub d: Option<u32>,
    pub t: Option<u32>,
    pub p: Option<u32>,
    pub c: Option<u32>,
    pub e: Option<u32>,
}

impl Dims {
    fn set(&mut self, letter: char, value: u32) {
        let slot = match letter {
            'd' => &mut self.d,
            't' => &mut self.t,
            'p' => &mut self.p,
            'c' => &mut self.c,
            _ => &mut self.e,
        };
        *slot = Some(value);
    }
}

/// The dimensions as written again (`d4t2`), for corrected examples.
impl std::fmt::Display for Dims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (letter, v) in [
            ('d', self.d),
            ('t', self.t),
            ('p', self.p),
            ('c', self.c),
            ('e', self.e),
        ] {
            if let Some(v) = v {
                write!(f, "{letter}{v}")?;
            }
        }
        Ok(())
    }
}

const ALL_DIMS: &str = "dtpce";

fn letters_list(allowed: &str) -> String {
    allowed
        .chars()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses one or more dimensions at the cursor. `allowed` is the subset of `dtpce` legal here and
/// `context` names the place ("inference backend `sglang`", "the `attn` section") for messages.
pub(crate) fn parse_dims(
    cur: &mut Cursor<'_>,
    allowed: &str,
    context: &str,
) -> Result<Dims, SchedulerError> {
    let mut dims = Dims::default();
    let mut count = 0usize;
    while let Some(letter) = cur.peek() {
        if !letter.is_ascii_alphabetic() {
            break;
        }
        let at = cur.pos();
        cur.bump();
        let digits = cur.digits();
        let end = cur.pos();
        let token = format!("{letter}{digits}");
        // Dropping the token fixes it, unless it is the only one (then `d1` keeps dims there).
        let more = cur.char_at(end).is_some_and(|c| c.is_ascii_alphabetic());
        let without = cur.splice(at, end, if count == 0 && !more { "d1" } else { "" });
        if !ALL_DIMS.contains(letter) {
            let lower = letter.to_ascii_lowercase();
            let (hint, example) = if ALL_DIMS.contains(lower) && !digits.is_empty() {
                (
                    " (dimension letters are lowercase)",
                    cur.splice(at, end, &format!("{lower}{digits}")),
                )
            } else {
                ("", without)
            };
            return Err(cur.error_at(
                at,
                format!(
                    "unknown parallel dimension `{letter}` in `{token}`{hint}; dimensions are \
                     d (data), t (tensor), p (pipeline), c (context), e (expert)"
                ),
                example,
            ));
        }
        if !allowed.contains(letter) {
            return Err(cur.error_at(
                at,
                format!(
                    "`{token}` is not allowed in {context}, which takes only {}",
                    letters_list(allowed)
                ),
                without,
            ));
        }
        if digits.is_empty() {
            return Err(cur.error_at(
                at,
                format!("dimension `{letter}` needs a size right after it, as in `{letter}4`"),
                cur.splice(at, end, &format!("{letter}1")),
            ));
        }
        if digits.starts_with('0') {
            let trimmed = digits.trim_start_matches('0');
            let fixed = if trimmed.is_empty() { "1" } else { trimmed };
            return Err(cur.error_at(
                at,
                format!("`{token}`: sizes are positive integers without leading zeros"),
                cur.splice(at, end, &format!("{letter}{fixed}")),
            ));
        }
        let Ok(value) = digits.parse::<u32>() else {
            return Err(cur.error_at(
                at,
                format!("`{token}`: size is too large (at most {})", u32::MAX),
                cur.splice(at, end, &format!("{letter}8")),
            ));
        };
        dims.set(letter, value);
        count += 1;
    }
    if count == 0 {
        let found = cur.found();
        let at = cur.pos();
        return Err(cur.error_at(
            at,
            format!("expected parallel dimensions such as `d4t2` for {context}, found {found}"),
            cur.splice(at, at, "d1"),
        ));
    }
    Ok(dims)
}
