//! PromQL's tokens, from the query's text.

use super::BinOp;
use super::parse_duration;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Token {
    Ident(String),
    Number(f64),
    /// A duration, in milliseconds (`5m`, `1h30m`).
    Duration(i64),
    Str(String),
    LBrace,
    RBrace,
    LParen,
    RParen,
    LBracket,
    RBracket,
    Comma,
    Eq,
    EqEq,
    Ne,
    Lt,
    Gt,
    Le,
    Ge,
    ReMatch,
    ReNotMatch,
    Plus,
    Minus,
    Star,
    Slash,
    Percent,
    Caret,
    /// `@`, a selector's or subquery's evaluation time.
    At,
    /// Anything else PromQL has (`@`, `:` in a subquery, ...): not supported here.
    Unsupported(String),
}

impl Token {
    pub(super) fn describe(&self) -> String {
        match self {
            Token::Ident(s) | Token::Unsupported(s) => format!("`{s}`"),
            Token::Number(n) => format!("number {n}"),
            Token::Duration(ms) => format!("duration {ms}ms"),
            Token::Str(s) => format!("string {s:?}"),
            other => format!("`{}`", other.symbol()),
        }
    }

    pub(super) fn symbol(&self) -> &'static str {
        match self {
            Token::LBrace => "{",
            Token::RBrace => "}",
            Token::LParen => "(",
            Token::RParen => ")",
            Token::LBracket => "[",
            Token::RBracket => "]",
            Token::Comma => ",",
            Token::Eq => "=",
            Token::EqEq => "==",
            Token::Ne => "!=",
            Token::Lt => "<",
            Token::Gt => ">",
            Token::Le => "<=",
            Token::Ge => ">=",
            Token::ReMatch => "=~",
            Token::ReNotMatch => "!~",
            Token::Plus => "+",
            Token::Minus => "-",
            Token::Star => "*",
            Token::Slash => "/",
            Token::Percent => "%",
            Token::Caret => "^",
            Token::At => "@",
            _ => "",
        }
    }

    pub(super) fn binary(&self) -> Option<BinOp> {
        Some(match self {
            Token::Caret => BinOp::Pow,
            Token::Star => BinOp::Mul,
            Token::Slash => BinOp::Div,
            Token::Percent => BinOp::Mod,
            Token::Plus => BinOp::Add,
            Token::Minus => BinOp::Sub,
            Token::EqEq => BinOp::Eq,
            Token::Ne => BinOp::Ne,
            Token::Lt => BinOp::Lt,
            Token::Gt => BinOp::Gt,
            Token::Le => BinOp::Le,
            Token::Ge => BinOp::Ge,
            // Keywords, in any case, as Prometheus reads them.
            Token::Ident(w) if w.eq_ignore_ascii_case("and") => BinOp::And,
            Token::Ident(w) if w.eq_ignore_ascii_case("or") => BinOp::Or,
            Token::Ident(w) if w.eq_ignore_ascii_case("unless") => BinOp::Unless,
            Token::Ident(w) if w.eq_ignore_ascii_case("atan2") => BinOp::Atan2,
            _ => return None,
        })
    }
}

pub(super) fn lex(text: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let (token, len) = match c {
            c if c.is_whitespace() => {
                i += 1;
                continue;
            }
            '#' => break, // a comment to the end: PromQL allows them; one line is all we get
            '{' => (Token::LBrace, 1),
            '}' => (Token::RBrace, 1),
            '(' => (Token::LParen, 1),
            ')' => (Token::RParen, 1),
            '[' => (Token::LBracket, 1),
            ']' => (Token::RBracket, 1),
            ',' => (Token::Comma, 1),
            '+' => (Token::Plus, 1),
            '-' => (Token::Minus, 1),
            '*' => (Token::Star, 1),
            '/' => (Token::Slash, 1),
            '%' => (Token::Percent, 1),
            '^' => (Token::Caret, 1),
            '@' => (Token::At, 1),
            '=' if next == Some('~') => (Token::ReMatch, 2),
            '=' if next == Some('=') => (Token::EqEq, 2),
            '=' => (Token::Eq, 1),
            '!' if next == Some('=') => (Token::Ne, 2),
            '!' if next == Some('~') => (Token::ReNotMatch, 2),
            '<' if next == Some('=') => (Token::Le, 2),
            '<' => (Token::Lt, 1),
            '>' if next == Some('=') => (Token::Ge, 2),
            '>' => (Token::Gt, 1),
            '"' | '\'' | '`' => {
                let (s, len) = string(&chars[i..])?;
                (Token::Str(s), len)
            }
            c if c.is_ascii_digit() || (c == '.' && next.is_some_and(|n| n.is_ascii_digit())) => {
                let len = chars[i..]
                    .iter()
                    .enumerate()
                    .take_while(|(k, d)| {
                        d.is_ascii_alphanumeric()
                            || **d == '.'
                            || ((**d == '+' || **d == '-')
                                && *k > 0
                                && matches!(chars[i + k - 1], 'e' | 'E'))
                    })
                    .count();
                let word: String = chars[i..i + len].iter().collect();
                let token = match integer(&word).or_else(|| word.parse::<f64>().ok()) {
                    Some(n) => Token::Number(n),
                    None => parse_duration(&word)
                        .map_or_else(|_| Token::Unsupported(word), Token::Duration),
                };
                (token, len)
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let len = chars[i..]
                    .iter()
                    .take_while(|d| d.is_ascii_alphanumeric() || **d == '_' || **d == ':')
                    .count();
                let word: String = chars[i..i + len].iter().collect();
                let token = match word.to_ascii_lowercase().as_str() {
                    "inf" => Token::Number(f64::INFINITY),
                    "nan" => Token::Number(f64::NAN),
                    _ => Token::Ident(word),
                };
                (token, len)
            }
            other => (Token::Unsupported(other.to_string()), 1),
        };
        out.push(token);
        i += len;
    }
    Ok(out)
}

/// An integer literal as Prometheus reads one first (Go's `ParseInt` with base 0): `0x3d` in
/// hexadecimal, `010` in octal (8), else decimal; `None` for what is not one (a float, a
/// duration), which is then read as a float.
fn integer(word: &str) -> Option<f64> {
    let (digits, radix) =
        if let Some(hex) = word.strip_prefix("0x").or_else(|| word.strip_prefix("0X")) {
            (hex, 16)
        } else if word.len() > 1 && word.starts_with('0') {
            (&word[1..], 8)
        } else {
            (word, 10)
        };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    // Past i64 Go's ParseInt fails and the float reading decides; the same here.
    i64::from_str_radix(digits, radix).ok().map(|n| n as f64)
}

/// A quoted string at the start of `chars`, with PromQL's (Go's) escapes; backquotes take none.
/// Returns the text and the characters it took.
pub(super) fn string(chars: &[char]) -> Result<(String, usize), String> {
    let quote = chars[0];
    let mut out = String::new();
    let mut i = 1;
    while i < chars.len() {
        let c = chars[i];
        if c == quote {
            return Ok((out, i + 1));
        }
        if c == '\\' && quote != '`' {
            let e = chars.get(i + 1).copied().ok_or("unterminated string")?;
            match e {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                '\\' | '"' | '\'' => out.push(e),
                // Regular expressions keep their own escapes: `\.` stays `\.`.
                other => {
                    out.push('\\');
                    out.push(other);
                }
            }
            i += 2;
            continue;
        }
        out.push(c);
        i += 1;
    }
    Err("unterminated string".into())
}
