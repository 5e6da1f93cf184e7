//! Hugging Face chat templates on minijinja, set up as `transformers` sets up Jinja for them
//! (`trim_blocks`, `lstrip_blocks`, loop controls, Python string methods, `raise_exception`,
//! `strftime_now`, and a `tojson` that writes what Python's `json.dumps` writes), so a model's
//! template renders here to the same text as in vLLM or SGLang.

use std::io;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

use crate::error::AgentError;

/// The name the compiled template is kept under.
const NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Whether each message's text depends on that message alone ([`ChatTemplate::local`]).
    local: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

impl ChatTemplate {
    /// Compiles `source` (HF's `{% generation %}` markers, which only mark assistant text for
    /// `transformers`' masks, are dropped first: minijinja has no such tag).
    pub fn new(source: &str) -> Result<Self, AgentError> {
        let source = strip_generation_tags(source);
        let local = is_local(&source);
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| AgentError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source).map_err(|e| {
            AgentError::Template(format!("the chat template does not compile: {e}"))
        })?;
        Ok(Self { env, local })
    }

    /// Whether the template writes each message from that message alone (and the request's
    /// tools and variables): it reads no loop position, no other message by index, no count
    /// of messages, and keeps no state across messages. Then the text of messages appended to a
    /// conversation is what rendering just those messages adds, whatever came before them, and
    /// a session's turn renders only its new messages; any other template is rendered whole,
    /// since what it writes for the history may change as the history grows (Qwen3's drops
    /// reasoning before the last user message, for one).
    pub fn local(&self) -> bool {
        self.local
    }

    /// Renders the template with `ctx` (messages, tools, add_generation_prompt, the special
    /// tokens and any template arguments).
    pub fn render(&self, ctx: Value) -> Result<String, AgentError> {
        let t = self
            .env
            .get_template(NAME)
            .map_err(|e| AgentError::Template(e.to_string()))?;
        t.render(ctx).map_err(|e| {
            // A template's own `raise_exception("…")` is the client's error, said plainly.
            let msg = match e.kind() {
                ErrorKind::InvalidOperation => {
                    e.detail().unwrap_or("invalid operation").to_string()
                }
                _ => e.to_string(),
            };
            AgentError::BadRequest(format!("the chat template refused the request: {msg}"))
        })
    }
}

fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        let Some(j) = rest[i..].find("%}") else { break };
        let tag = rest[i + 2..i + j].trim_matches(|c: char| c == '-' || c.is_whitespace());
        out.push_str(&rest[..i]);
        if tag != "generation" && tag != "endgeneration" {
            out.push_str(&rest[i..i + j + 2]);
        }
        rest = &rest[i + j + 2..];
    }
    out.push_str(rest);
    out
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> String {
    jiff::Timestamp::now().strftime(&fmt).to_string()
}

/// Python's `json.dumps` layout: `", "` and `": "` between items, or one item a line with
/// `indent`; non-ASCII kept; keys in their order.
struct PyJson {
    indent: Option<Vec<u8>>,
    level: usize,
    has_value: bool,
}

impl PyJson {
    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(ind) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(ind)?;
            }
        }
        Ok(())
    }

    fn separator<W: ?Sized + io::Write>(&self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyJson {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b"]")
    }
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.separator(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b"}")
    }
    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.separator(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Python's `json.dumps` for templates' `tojson` (minijinja's own escapes HTML characters).
pub fn py_json(value: &impl Serialize, indent: Option<Vec<u8>>) -> Result<String, String> {
    let mut out = Vec::new();
    let fmt = PyJson {
        indent,
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    value.serialize(&mut ser).map_err(|e| e.to_string())?;
    String::from_utf8(out).map_err(|e| e.to_string())
}

fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        Some(v) if !v.is_none() => Some(match v.as_str() {
            Some(s) => s.as_bytes().to_vec(),
            None => vec![b' '; usize::try_from(v)?.min(64)],
        }),
        _ => None,
    };
    py_json(value, indent)
        .map(Value::from_safe_string)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

/// [`ChatTemplate::local`] read from the source: none of the constructs through which a
/// message's text can depend on the others.
fn is_local(source: &str) -> bool {
    const HISTORY: &[&str] = &[
        "loop.",
        "messages[",
        "messages|",
        "messages |",
        "namespace",
        "ns.",
        "last_query",
        "reasoning_content",
        "previtem",
        "nextitem",
        "{% set",
        "{%- set",
    ];
    !HISTORY.iter().any(|h| source.contains(h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    #[test]
    fn tojson_writes_what_python_writes() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}").unwrap();
        let x = Value::from(minijinja::value::Serde(
            serde_json::json!({"a": [1, "é<&>"]}),
        ));
        let got = t.render(context! { x => x }).unwrap();
        assert_eq!(
            got,
            "{\"a\": [1, \"é<&>\"]}|{\n  \"a\": [\n    1,\n    \"é<&>\"\n  ]\n}"
        );
    }

    #[test]
    fn a_templates_own_exception_is_a_bad_request() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}").unwrap();
        let e = t.render(context! {}).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
        assert!(ChatTemplate::new("{% for %}").is_err());
    }

    #[test]
    fn generation_markers_and_python_methods() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% generation %}{{ m.content.strip() | upper }}{% endgeneration %}{% endfor %}",
        )
        .unwrap();
        let msgs = Value::from(minijinja::value::Serde(
            serde_json::json!([{"content": " hi "}]),
        ));
        assert_eq!(t.render(context! { messages => msgs }).unwrap(), "HI");
    }
}
