//! Keeps ARCHITECTURE.md and the numbered invariants honest.
//!
//! Scans every `.rs` file under the workspace root (skipping `target/`, hidden directories
//! and this file, whose fixtures are not citations) and `ARCHITECTURE.md`, and fails with one
//! list of every problem:
//!
//! 1. an invariant ID defined twice, or cited but never defined;
//! 2. an invariant ID defined but cited by no test;
//! 3. a path in ARCHITECTURE.md's "Concepts" or "Invariants" table that does not exist;
//! 4. an invariant prefix missing from the "Invariants" index, indexed without any definition,
//!    or defined outside the paths the index gives for it;
//! 5. a code reference to a section of ARCHITECTURE.md (`ARCHITECTURE.md, "Schedule"`,
//!    `ARCHITECTURE.md ("runtime / Sharding")`) naming a heading the file does not have.
//!
//! The rules, exactly:
//!
//! - **ID**: two or more capital letters, a hyphen and digits (`ENG-10`), not preceded by a
//!   letter, digit, `_`, `-` or `$` and not followed by a letter, digit or `_`; so `FNV-1a`,
//!   `x86-64` and the `W-1` of `0..W-1` are not IDs. Prefixes in [`NOT_INVARIANTS`] are not IDs.
//! - **Range**: `P-a..P-b`, `P-a..b`, `P-a to P-b` and `P-a through P-b` (b > a) name every ID
//!   from `P-a` to `P-b`.
//! - **Definition**: a `//!` or `///` line that is a list item (`- ` or `* `) starting with an
//!   ID, or a `//!` line that starts a paragraph (the first doc line, or after a blank one)
//!   with an ID; the ID may be in `**bold**` or `` `code` `` and may carry a parenthesised
//!   qualifier, and is followed by a colon: `//! - ENG-5 (stage 3): ...`,
//!   `//! - **OPT-1**: ...`, `` //! `LOSS-1`: ... ``. A definition names one ID.
//! - **Citation**: every other occurrence of an ID (code, comment or string) in a `.rs` file
//!   or in ARCHITECTURE.md, ranges expanded.
//! - **Test citation**: a citation in test code: a file inside a crate's `tests/` directory
//!   (`collectives/tests/`, `tests/tests/`; the `shardline-tests` crate's own `tests/src/` is
//!   library code), a module or item under `#[cfg(test)]` (inline, or `mod x;` and everything
//!   below it), or a `#[test]` function, with the doc comments and attributes just above it.
//!   The name of a function in test code also cites the IDs it ends with in snake case, for a
//!   defined prefix: `reuses_and_bounds_pool_1_2` cites POOL-1 and POOL-2 (`reshard_4_to_2_to_3`
//!   cites nothing while no prefix TO is defined).
//! - **Concept table / invariant index**: the first table under the headings "Concepts" and
//!   "Invariants" of ARCHITECTURE.md. Every backticked path in the second column of the
//!   concept table and the third column of the index must exist (relative to the repository
//!   root; a trailing `/` asks for a directory). The index's first column holds the prefix in
//!   backticks (`` `ENG` ``); every definition of that prefix must lie in (or under) one of the
//!   row's paths.
//! - **Section reference**: `ARCHITECTURE.md` in a `.rs` file followed by an optional `,` or
//!   `(` and a double-quoted name. `a / b` names heading `b` inside the section of heading `a`.
//!   Headings are compared exactly, backticks removed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Tokens of the ID form that are not invariants (the prefix before the hyphen).
const NOT_INVARIANTS: &[&str] = &[
    "SHA",  // SHA-256 (checkpoint checksums)
    "AVX",  // AVX-512 (backend measurements)
    "UTF",  // UTF-8
    "CRC",  // CRC-32
    "FNV",  // FNV-1a; the trailing `a` already makes it no ID
    "ISO",  // ISO-8601 times
    "RFC",  // RFC-nnnn
    "IEEE", // IEEE-754
];

/// Heading of the concept table in ARCHITECTURE.md.
const CONCEPTS: &str = "Concepts";
/// Heading of the invariant index in ARCHITECTURE.md.
const INVARIANTS: &str = "Invariants";

// ---------------------------------------------------------------------------------------
// Lexing: which bytes of a Rust file are code, comment or literal.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Code,
    Comment,
    Literal,
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Classifies every byte of `src`: code, comment (line or nested block) or literal (string,
/// raw string, byte string, char).
fn classify(src: &str) -> Vec<Kind> {
    let b = src.as_bytes();
    let mut k = vec![Kind::Code; b.len()];
    let mut i = 0;
    let mark = |k: &mut Vec<Kind>, a: usize, e: usize, kind: Kind| {
        k[a..e.min(b.len())].iter_mut().for_each(|x| *x = kind);
    };
    while i < b.len() {
        let prev_ident = i > 0 && is_ident(b[i - 1]);
        if b[i..].starts_with(b"//") {
            let e = src[i..].find('\n').map_or(b.len(), |n| i + n);
            mark(&mut k, i, e, Kind::Comment);
            i = e;
        } else if b[i..].starts_with(b"/*") {
            let (mut depth, mut j) = (1, i + 2);
            while j < b.len() && depth > 0 {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            mark(&mut k, i, j, Kind::Comment);
            i = j;
        } else if (b[i] == b'r' || b[i..].starts_with(b"br")) && !prev_ident {
            // Raw string r"..", r#".."#, br"..": ends at `"` and the same number of `#`.
            let s = if b[i] == b'r' { i + 1 } else { i + 2 };
            let hashes = b[s..].iter().take_while(|&&c| c == b'#').count();
            if b.get(s + hashes) == Some(&b'"') {
                let close: Vec<u8> =
                    std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
                let body = s + hashes + 1;
                let e = b[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| body + p + close.len());
                mark(&mut k, i, e, Kind::Literal);
                i = e;
            } else {
                i += 1;
            }
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            mark(&mut k, i, j + 1, Kind::Literal);
            i = j + 1;
        } else if b[i] == b'\'' {
            // A char literal ('a', '\n', '\u{..}', 'é'), else a lifetime or label.
            let e = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..].iter().position(|&c| c == b'\'').map(|p| i + 2 + p + 1)
            } else {
                src.get(i + 1..)
                    .and_then(|r| r.chars().next())
                    .map(|c| i + 1 + c.len_utf8())
                    .filter(|&j| b.get(j) == Some(&b'\''))
                    .map(|j| j + 1)
            };
            match e {
                Some(e) => {
                    mark(&mut k, i, e, Kind::Literal);
                    i = e;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    k
}

/// Offsets of `pat` in `src` where it lies in code.
fn find_code(src: &str, kinds: &[Kind], pat: &str) -> Vec<usize> {
    src.match_indices(pat).map(|(i, _)| i).filter(|&i| kinds[i] == Kind::Code).collect()
}

/// The offset just past the bracket that closes the one at `open` (`{`, `[` or `(`), in code.
fn close_of(src: &str, kinds: &[Kind], open: usize) -> Option<usize> {
    let b = src.as_bytes();
    let mut depth = 0usize;
    for i in open..b.len() {
        if kinds[i] != Kind::Code {
            continue;
        }
        match b[i] {
            b'{' | b'[' | b'(' => depth += 1,
            b'}' | b']' | b')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The item that follows an attribute ending at `from`: skips comments and further
/// attributes. Returns (start of the item, end of the item: past its `;` or its body's `}`).
fn item_after(src: &str, kinds: &[Kind], from: usize) -> Option<(usize, usize)> {
    let b = src.as_bytes();
    let mut i = from;
    loop {
        while i < b.len() && (kinds[i] != Kind::Code || b[i].is_ascii_whitespace()) {
            i += 1;
        }
        if b[i..].starts_with(b"#[") {
            i = close_of(src, kinds, i + 1)?;
        } else {
            break;
        }
    }
    let start = i;
    let mut depth = 0usize;
    for j in start..b.len() {
        if kinds[j] != Kind::Code {
            continue;
        }
        match b[j] {
            b'(' | b'[' | b'<' => depth += 1,
            b')' | b']' | b'>' => depth = depth.saturating_sub(1),
            b';' if depth == 0 => return Some((start, j + 1)),
            b'{' => return Some((start, close_of(src, kinds, j)?)),
            _ => {}
        }
    }
    None
}

/// `mod name;` (any visibility) at `item`: the module's name.
fn out_of_line_mod(item: &str) -> Option<&str> {
    let mut t = item.trim_start();
    if let Some(r) = t.strip_prefix("pub") {
        t = r.trim_start();
        if t.starts_with('(') {
            t = t[t.find(')')? + 1..].trim_start();
        }
    }
    let rest = t.strip_prefix("mod")?.trim_start();
    let name: &str = &rest[..rest.bytes().take_while(|&c| is_ident(c)).count()];
    let after = rest[name.len()..].trim_start();
    (!name.is_empty() && after.starts_with(';')).then_some(name)
}

/// Where a file's test code is, and which out-of-line modules it declares.
#[derive(Debug, Default, PartialEq)]
struct TestLayout {
    /// Byte ranges of test code (`#[cfg(test)]` items and `#[test]` functions, with the doc
    /// comments and attributes just above them).
    regions: Vec<(usize, usize)>,
    /// `mod x;` declarations: (name, under `#[cfg(test)]`).
    mods: Vec<(String, bool)>,
}

/// Start of the line holding `at`, moved up over the doc comments, comments and attributes
/// just above it.
fn attached_start(src: &str, at: usize) -> usize {
    let mut start = src[..at].rfind('\n').map_or(0, |n| n + 1);
    while start > 0 {
        let prev = src[..start - 1].rfind('\n').map_or(0, |n| n + 1);
        let line = src[prev..start - 1].trim_start();
        let attached =
            (line.starts_with("//") && !line.starts_with("//!")) || line.starts_with("#[");
        if !attached {
            break;
        }
        start = prev;
    }
    start
}

fn test_layout(src: &str) -> TestLayout {
    let kinds = classify(src);
    let mut out = TestLayout::default();
    for (attr, is_cfg) in find_code(src, &kinds, "#[cfg(test)]")
        .into_iter()
        .map(|i| (i, true))
        .chain(find_code(src, &kinds, "#[test]").into_iter().map(|i| (i, false)))
    {
        let end_of_attr = attr + if is_cfg { "#[cfg(test)]".len() } else { "#[test]".len() };
        let Some((item, end)) = item_after(src, &kinds, end_of_attr) else { continue };
        out.regions.push((attached_start(src, attr), end));
        if let Some(name) = out_of_line_mod(&src[item..end]).filter(|_| is_cfg) {
            out.mods.push((name.to_string(), true));
        }
    }
    // Every other `mod x;`, to follow test modules' children.
    for m in find_code(src, &kinds, "mod ") {
        if m > 0 && is_ident(src.as_bytes()[m - 1]) {
            continue;
        }
        let line = src[..m].rfind('\n').map_or(0, |n| n + 1);
        if let Some(name) = out_of_line_mod(&src[line..]) {
            if !out.mods.iter().any(|(n, _)| n == name) {
                out.mods.push((name.to_string(), false));
            }
        }
    }
    out.regions.sort_unstable();
    out
}

/// The file of out-of-line module `name` declared in `parent`: beside it for `mod.rs` and
/// crate roots (`lib.rs`, `main.rs`, files of `tests/`, `examples/`, `benches/`, `src/bin/`),
/// else in the directory named after it; `name.rs` or `name/mod.rs`.
fn child_module(parent: &Path, name: &str) -> [PathBuf; 2] {
    let dir = parent.parent().unwrap_or(Path::new(""));
    let stem = parent.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let in_root_dir = dir
        .file_name()
        .is_some_and(|d| ["tests", "examples", "benches", "bin"].iter().any(|r| d == *r));
    let beside = matches!(stem, "mod" | "lib" | "main") || in_root_dir;
    let base = if beside { dir.to_path_buf() } else { dir.join(stem) };
    [base.join(format!("{name}.rs")), base.join(name).join("mod.rs")]
}

// ---------------------------------------------------------------------------------------
// IDs, ranges, definitions.

/// One ID found in a text: its byte offset and the ID (a range gives one per ID, all at the
/// offset of its first).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Found {
    at: usize,
    id: String,
}

/// `P-n` at the start of `s` (no boundary check before it): (prefix, number, length).
fn id_at(s: &str) -> Option<(&str, u32, usize)> {
    let b = s.as_bytes();
    let p = b.iter().take_while(|c| c.is_ascii_uppercase()).count();
    if p < 2 || b.get(p) != Some(&b'-') {
        return None;
    }
    let d = b[p + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
    if d == 0 || b.get(p + 1 + d).is_some_and(|&c| is_ident(c)) {
        return None;
    }
    let n = s[p + 1..p + 1 + d].parse().ok()?;
    Some((&s[..p], n, p + 1 + d))
}

/// Every invariant ID in `text`, ranges expanded.
fn scan_ids(text: &str) -> Vec<Found> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let boundary = b[i].is_ascii_uppercase()
            && (i == 0 || !(is_ident(b[i - 1]) || b[i - 1] == b'-' || b[i - 1] == b'$'));
        let Some((prefix, a, len)) = boundary.then(|| id_at(&text[i..])).flatten() else {
            i += 1;
            continue;
        };
        if NOT_INVARIANTS.contains(&prefix) {
            i += len;
            continue;
        }
        let rest = &text[i + len..];
        // The end of a range, if one follows: (its number, bytes up to its end).
        let end = ["..=", "..", " to ", " through "].iter().find_map(|sep| {
            let r = rest.strip_prefix(sep)?;
            match id_at(r) {
                Some((p, n, l)) if p == prefix => Some((n, sep.len() + l)),
                _ if sep.starts_with('.') => {
                    let d = r.bytes().take_while(|c| c.is_ascii_digit()).count();
                    let ok = d > 0 && !r.as_bytes().get(d).is_some_and(|&c| is_ident(c));
                    ok.then(|| r[..d].parse().ok().map(|n| (n, sep.len() + d))).flatten()
                }
                _ => None,
            }
        });
        match end.filter(|&(e, _)| e > a && e - a <= 1000) {
            Some((last, l)) => {
                out.extend((a..=last).map(|n| Found { at: i, id: format!("{prefix}-{n}") }));
                i += len + l;
            }
            None => {
                out.push(Found { at: i, id: format!("{prefix}-{a}") });
                i += len;
            }
        }
    }
    out
}

/// The ID a doc line's text defines (the text after `//!` or `///`), see the rules above.
fn definition(text: &str, paragraph_start: bool) -> Option<String> {
    let t = text.trim_start();
    let t = match t.strip_prefix("- ").or_else(|| t.strip_prefix("* ")) {
        Some(r) => r.trim_start(),
        None if paragraph_start => t,
        None => return None,
    };
    let mark = ["**", "`"].into_iter().find(|m| t.starts_with(m)).unwrap_or("");
    let t = &t[mark.len()..];
    let (prefix, n, len) = id_at(t)?;
    if NOT_INVARIANTS.contains(&prefix) {
        return None;
    }
    let mut r = t[len..].strip_prefix(mark)?.trim_start();
    if r.starts_with('(') {
        r = r[r.find(')')? + 1..].trim_start();
    }
    r.starts_with(':').then(|| format!("{prefix}-{n}"))
}

/// The IDs a test function's name ends with, in snake case, for a known prefix:
/// `reuses_and_bounds_pool_1_2` names POOL-1 and POOL-2 when POOL is a defined prefix.
fn name_cites(name: &str, prefixes: &BTreeSet<String>) -> Vec<String> {
    let parts: Vec<&str> = name.split('_').collect();
    let nums = parts
        .iter()
        .rev()
        .take_while(|p| !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()))
        .count();
    let Some(prefix) = parts.len().checked_sub(nums + 1).map(|i| parts[i].to_ascii_uppercase())
    else {
        return Vec::new();
    };
    if nums == 0 || !prefixes.contains(&prefix) {
        return Vec::new();
    }
    parts[parts.len() - nums..]
        .iter()
        .map(|n| format!("{prefix}-{}", n.trim_start_matches('0')))
        .collect()
}

/// Kind of doc comment a line is: `//!` (inner) or `///` (outer, not `////`).
fn doc_text(line: &str) -> Option<(bool, &str)> {
    let t = line.trim_start();
    if let Some(r) = t.strip_prefix("//!") {
        Some((true, r))
    } else {
        t.strip_prefix("///").filter(|r| !r.starts_with('/')).map(|r| (false, r))
    }
}

/// Definitions in a Rust source: (line, ID).
fn definitions(src: &str, kinds: &[Kind]) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut prev_blank_inner = true;
    let mut off = 0;
    for (n, line) in src.split('\n').enumerate() {
        let lead = line.len() - line.trim_start().len();
        let doc = doc_text(line).filter(|_| kinds.get(off + lead) == Some(&Kind::Comment));
        if let Some((inner, text)) = doc {
            if let Some(id) = definition(text, inner && prev_blank_inner) {
                out.push((n + 1, id));
            }
            prev_blank_inner = inner && text.trim().is_empty();
        } else {
            prev_blank_inner = true;
        }
        off += line.len() + 1;
    }
    out
}

// ---------------------------------------------------------------------------------------
// ARCHITECTURE.md: headings, tables, references to its sections.

/// Headings outside code fences: (level, text without backticks).
fn headings(md: &str) -> Vec<(usize, String)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let level = line.bytes().take_while(|&c| c == b'#').count();
        if !fenced && level > 0 && line.as_bytes().get(level) == Some(&b' ') {
            let text = line[level..].trim().trim_end_matches('#').trim().replace('`', "");
            out.push((level, text));
        }
    }
    out
}

/// Whether `path` (`a / b / c`) names nested headings of `hs`.
fn has_section(hs: &[(usize, String)], path: &str) -> bool {
    fn within(hs: &[(usize, String)], parts: &[&str], min_level: usize) -> bool {
        let Some((first, rest)) = parts.split_first() else { return true };
        hs.iter().enumerate().any(|(i, (level, text))| {
            if *level <= min_level || text != first {
                return false;
            }
            // The section runs to the next heading of this level or above.
            let end =
                hs[i + 1..].iter().position(|(l, _)| l <= level).map_or(hs.len(), |p| i + 1 + p);
            within(&hs[i + 1..end], rest, *level)
        })
    }
    let parts: Vec<&str> = path.split('/').map(str::trim).collect();
    // A top-level part may sit at any level; a later one inside the former's section.
    within(hs, &parts, 0)
}

/// The rows of the first table under heading `name`: (line, cells).
fn table(md: &str, name: &str) -> Option<Vec<(usize, Vec<String>)>> {
    let lines: Vec<&str> = md.lines().collect();
    let mut fenced = false;
    let mut at = None;
    for (i, l) in lines.iter().enumerate() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let level = l.bytes().take_while(|&c| c == b'#').count();
        if !fenced && level > 0 && l[level..].trim().replace('`', "") == name {
            at = Some(i);
            break;
        }
    }
    let mut rows = Vec::new();
    for (i, l) in lines.iter().enumerate().skip(at? + 1) {
        if l.starts_with('#') {
            break;
        }
        let t = l.trim();
        if !t.starts_with('|') {
            if !rows.is_empty() {
                break;
            }
            continue;
        }
        let cells: Vec<String> =
            t.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect();
        if cells.iter().all(|c| c.chars().all(|ch| matches!(ch, '-' | ':' | ' '))) {
            continue;
        }
        rows.push((i + 1, cells));
    }
    if !rows.is_empty() {
        rows.remove(0); // the header
    }
    Some(rows)
}

/// The backticked spans of a table cell.
fn backticked(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// Section names cited in a Rust source: (offset, name).
fn section_refs(src: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, _) in src.match_indices("ARCHITECTURE.md") {
        if src[i + "ARCHITECTURE.md".len()..].starts_with('"') {
            continue; // the file's name in a string, not a reference
        }
        // The text after it, comment leaders of continuation lines removed.
        let tail: String = src[i + "ARCHITECTURE.md".len()..]
            .lines()
            .take(3)
            .enumerate()
            .map(|(n, l)| {
                let t = if n == 0 { l } else { l.trim_start() };
                let t = t.trim_start_matches("//!").trim_start_matches("///");
                let t = if n == 0 { t } else { t.trim_start_matches("//") };
                format!("{t} ")
            })
            .collect();
        let t = tail.trim_start();
        let t = t.strip_prefix(',').unwrap_or(t).trim_start();
        let t = t.strip_prefix('(').unwrap_or(t).trim_start();
        if let Some(r) = t.strip_prefix('"') {
            if let Some(e) = r.find('"') {
                let name = r[..e].split_whitespace().collect::<Vec<_>>().join(" ");
                out.push((i, name));
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The scan.

/// Where something was found: path relative to the root, line.
type At = (String, usize);

fn line_of(src: &str, offset: usize) -> usize {
    src[..offset].bytes().filter(|&c| c == b'\n').count() + 1
}

fn rust_files(root: &Path, skip: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() && !name.starts_with('.') && name != "target" {
                stack.push(p);
            } else if ft.is_file() && name.ends_with(".rs") && p != skip {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Whether a file lies in a crate's `tests/` directory (not the root's own `tests/` crate).
fn in_tests_dir(rel: &Path) -> bool {
    let comps: Vec<_> = rel.components().collect();
    comps.iter().take(comps.len().saturating_sub(1)).skip(1).any(|c| c.as_os_str() == "tests")
}

#[derive(Default)]
struct Scan {
    defs: BTreeMap<String, Vec<At>>,
    cites: BTreeMap<String, Vec<At>>,
    test_cites: BTreeMap<String, Vec<At>>,
    section_refs: Vec<(At, String)>,
}

fn scan(root: &Path, skip: &Path) -> Scan {
    let files = rust_files(root, skip);
    let rel = |p: &Path| p.strip_prefix(root).unwrap_or(p).to_path_buf();
    let sources: BTreeMap<PathBuf, String> =
        files.iter().filter_map(|p| std::fs::read_to_string(p).ok().map(|s| (rel(p), s))).collect();
    let layouts: BTreeMap<&PathBuf, TestLayout> =
        sources.iter().map(|(p, s)| (p, test_layout(s))).collect();
    // Whole files of test code: in a tests/ directory, or reached through `#[cfg(test)] mod`.
    let mut test_files: BTreeSet<PathBuf> =
        sources.keys().filter(|p| in_tests_dir(p)).cloned().collect();
    let mut todo: Vec<(PathBuf, bool)> = sources.keys().map(|p| (p.clone(), false)).collect();
    while let Some((file, inherited)) = todo.pop() {
        let is_test = inherited || test_files.contains(&file);
        for (name, cfg_test) in layouts.get(&file).map_or(&[][..], |l| &l.mods[..]) {
            if !(is_test || *cfg_test) {
                continue;
            }
            for child in child_module(&file, name) {
                if sources.contains_key(&child) && test_files.insert(child.clone()) {
                    todo.push((child, true));
                }
            }
        }
    }
    let mut s = Scan::default();
    let kinds: BTreeMap<&PathBuf, Vec<Kind>> =
        sources.iter().map(|(p, src)| (p, classify(src))).collect();
    let defs: BTreeMap<&PathBuf, Vec<(usize, String)>> =
        sources.iter().map(|(p, src)| (p, definitions(src, &kinds[p]))).collect();
    for (path, d) in &defs {
        for (line, id) in d {
            let at = (path.to_string_lossy().into_owned(), *line);
            s.defs.entry(id.clone()).or_default().push(at);
        }
    }
    let prefixes: BTreeSet<String> =
        s.defs.keys().filter_map(|id| id.rsplit_once('-')).map(|(p, _)| p.to_string()).collect();
    for (path, src) in &sources {
        let name = path.to_string_lossy().into_owned();
        let whole = test_files.contains(path);
        let regions = &layouts[path].regions;
        let in_test = |at: usize| whole || regions.iter().any(|&(a, e)| a <= at && at < e);
        for f in scan_ids(src) {
            let line = line_of(src, f.at);
            if defs[path].iter().any(|(l, id)| *l == line && *id == f.id) {
                continue;
            }
            let at = (name.clone(), line);
            if in_test(f.at) {
                s.test_cites.entry(f.id.clone()).or_default().push(at.clone());
            }
            s.cites.entry(f.id).or_default().push(at);
        }
        for at in find_code(src, &kinds[path], "fn ") {
            if (at > 0 && is_ident(src.as_bytes()[at - 1])) || !in_test(at) {
                continue;
            }
            let rest = &src[at + 3..];
            for id in
                name_cites(&rest[..rest.bytes().take_while(|&c| is_ident(c)).count()], &prefixes)
            {
                s.test_cites.entry(id).or_default().push((name.clone(), line_of(src, at)));
            }
        }
        for (off, section) in section_refs(src) {
            s.section_refs.push(((name.clone(), line_of(src, off)), section));
        }
    }
    s
}

/// Whether `file` is the listed path, or lies under it when it is a directory (`dir/`).
fn lies_in(file: &str, listed: &str) -> bool {
    match listed.strip_suffix('/') {
        Some(dir) => file.starts_with(&format!("{dir}/")),
        None => file == listed,
    }
}

/// Sort key of an ID: its prefix, then its number (`ZED-2` before `ZED-10`).
fn id_key(id: &str) -> (String, u32) {
    let (p, n) = id.rsplit_once('-').unwrap_or((id, ""));
    (p.to_string(), n.parse().unwrap_or(0))
}

/// Report lines of `ids` in ID order.
fn by_id<'a, T>(
    ids: impl Iterator<Item = (&'a String, T)>,
    line: impl Fn(&str, T) -> String,
) -> Vec<String> {
    let mut v: Vec<(&String, T)> = ids.collect();
    v.sort_by_key(|(id, _)| id_key(id));
    v.into_iter().map(|(id, t)| line(id, t)).collect()
}

fn fmt_at(v: &[At]) -> String {
    v.iter().map(|(f, l)| format!("{f}:{l}")).collect::<Vec<_>>().join(", ")
}

/// Every problem, one line each, grouped under a title.
fn problems(root: &Path, skip: &Path) -> Vec<(String, Vec<String>)> {
    let s = scan(root, skip);
    let md_path = root.join("ARCHITECTURE.md");
    let md = std::fs::read_to_string(&md_path).unwrap_or_default();
    let mut cites = s.cites.clone();
    for f in scan_ids(&md) {
        cites.entry(f.id).or_default().push(("ARCHITECTURE.md".into(), line_of(&md, f.at)));
    }
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    let mut add = |title: &str, items: Vec<String>| {
        if !items.is_empty() {
            groups.push((title.to_string(), items));
        }
    };
    add(
        "invariant defined more than once",
        by_id(s.defs.iter().filter(|(_, v)| v.len() > 1), |id, v| format!("{id}: {}", fmt_at(v))),
    );
    add(
        "invariant cited but never defined",
        by_id(cites.iter().filter(|(id, _)| !s.defs.contains_key(*id)), |id, v| {
            format!("{id}: cited at {}", fmt_at(v))
        }),
    );
    add(
        "invariant defined but cited by no test",
        by_id(s.defs.iter().filter(|(id, _)| !s.test_cites.contains_key(*id)), |id, v| {
            format!("{id}: defined at {}", fmt_at(v))
        }),
    );
    if md.is_empty() {
        add("ARCHITECTURE.md", vec![format!("{} is missing or empty", md_path.display())]);
        return groups;
    }
    let mut paths = Vec::new();
    let mut index = Vec::new();
    for (heading, col) in [(CONCEPTS, 1), (INVARIANTS, 2)] {
        match table(&md, heading) {
            None => add("ARCHITECTURE.md", vec![format!("no table under a heading \"{heading}\"")]),
            Some(rows) => {
                for (line, cells) in rows {
                    let listed: Vec<String> = cells
                        .get(col)
                        .map(|c| backticked(c))
                        .unwrap_or_default()
                        .into_iter()
                        .map(String::from)
                        .collect();
                    for p in &listed {
                        let full = root.join(p);
                        let ok = if p.ends_with('/') { full.is_dir() } else { full.exists() };
                        if !ok {
                            paths.push(format!("ARCHITECTURE.md:{line}: `{p}` ({heading})"));
                        }
                    }
                    if heading == INVARIANTS {
                        let prefixes = cells.first().map(|c| backticked(c)).unwrap_or_default();
                        for prefix in prefixes {
                            index.push((line, prefix.to_string(), listed.clone()));
                        }
                    }
                }
            }
        }
    }
    add("path in ARCHITECTURE.md that does not exist", paths);
    let mut by_prefix: BTreeMap<String, Vec<&At>> = BTreeMap::new();
    for (id, v) in &s.defs {
        let prefix = id.rsplit_once('-').map_or(id.as_str(), |(p, _)| p).to_string();
        by_prefix.entry(prefix).or_default().extend(v);
    }
    let mut idx = Vec::new();
    for (prefix, defs) in &by_prefix {
        let rows: Vec<_> = index.iter().filter(|(_, p, _)| p == prefix).collect();
        let Some(first) = rows.first() else {
            idx.push(format!("{prefix}: defined in {} but not in the index", defs[0].0));
            continue;
        };
        let listed: Vec<&String> = rows.iter().flat_map(|(_, _, l)| l).collect();
        let outside: BTreeSet<&String> = defs
            .iter()
            .map(|(file, _)| file)
            .filter(|file| !listed.iter().any(|p| lies_in(file, p)))
            .collect();
        for file in outside {
            idx.push(format!(
                "{prefix}: defined in {file}, the index (ARCHITECTURE.md:{}) says {listed:?}",
                first.0
            ));
        }
    }
    for (line, prefix, _) in &index {
        if !by_prefix.contains_key(prefix) {
            idx.push(format!("{prefix}: indexed at ARCHITECTURE.md:{line} but never defined"));
        }
    }
    add("invariant index (ARCHITECTURE.md, \"Invariants\") disagrees with the definitions", idx);
    let hs = headings(&md);
    add(
        "reference to a section ARCHITECTURE.md does not have",
        s.section_refs
            .iter()
            .filter(|(_, section)| !has_section(&hs, section))
            .map(|((f, l), section)| format!("{f}:{l}: \"{section}\""))
            .collect(),
    );
    groups
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn architecture_and_invariants_are_honest() {
    let root = workspace_root().canonicalize().expect("workspace root");
    // This file, as the scan names it: `<root>/<this crate's directory>/tests/architecture.rs`.
    let krate = Path::new(env!("CARGO_MANIFEST_DIR")).file_name().expect("crate directory");
    let me = root.join(krate).join("tests").join("architecture.rs");
    let groups = problems(&root, &me);
    if groups.is_empty() {
        return;
    }
    let total: usize = groups.iter().map(|(_, v)| v.len()).sum();
    let mut msg = format!(
        "ARCHITECTURE.md and the numbered invariants disagree with the code: {total} problems \
         (rules in tests/tests/architecture.rs)\n"
    );
    for (title, items) in &groups {
        msg.push_str(&format!("\n{title} ({}):\n", items.len()));
        for it in items {
            msg.push_str(&format!("  {it}\n"));
        }
    }
    panic!("{msg}");
}

// ---------------------------------------------------------------------------------------
// The pure parts, checked on small inputs. (Fixtures use the prefixes `ZED` and `QUX`; this
// file is not scanned, so they cite nothing.)

#[test]
fn ids_need_two_capitals_a_hyphen_digits_and_boundaries() {
    let ids = |t: &str| scan_ids(t).into_iter().map(|f| f.id).collect::<Vec<_>>();
    assert_eq!(ids("see ZED-1 and (QUX-12)."), ["ZED-1", "QUX-12"]);
    assert_eq!(ids("`ZED-3`: **QUX-4**"), ["ZED-3", "QUX-4"]);
    // Not IDs: one capital, lowercase tails, glued on, allow-listed prefixes.
    assert!(ids("0..W-1, FNV-1a, x86-64, ZED-1x, aZED-1, A-ZED-1, $ZED-1, ZEd-1").is_empty());
    assert!(ids("SHA-256 AVX-512 UTF-8 CRC-32").is_empty());
    assert_eq!(scan_ids("ab ZED-7")[0].at, 3);
}

#[test]
fn ranges_name_every_id_between_their_ends() {
    let ids = |t: &str| scan_ids(t).into_iter().map(|f| f.id).collect::<Vec<_>>();
    assert_eq!(ids("ZED-1..ZED-3"), ["ZED-1", "ZED-2", "ZED-3"]);
    assert_eq!(ids("(ZED-1..3)"), ["ZED-1", "ZED-2", "ZED-3"]);
    assert_eq!(ids("ZED-6 to ZED-8 hold"), ["ZED-6", "ZED-7", "ZED-8"]);
    assert_eq!(ids("ZED-1 through ZED-2"), ["ZED-1", "ZED-2"]);
    // Not ranges: another prefix, a bare number after "to", a backward range.
    assert_eq!(ids("ZED-1..QUX-3"), ["ZED-1", "QUX-3"]);
    assert_eq!(ids("ZED-1 to 4 ranks"), ["ZED-1"]);
    assert_eq!(ids("ZED-5..2"), ["ZED-5"]);
}

#[test]
fn definitions_are_list_items_or_paragraph_starts() {
    assert_eq!(definition(" - ZED-1: text", false).as_deref(), Some("ZED-1"));
    assert_eq!(definition(" - **ZED-2**: text", false).as_deref(), Some("ZED-2"));
    assert_eq!(definition(" - `ZED-3`: text", false).as_deref(), Some("ZED-3"));
    assert_eq!(definition(" * ZED-4 (stage 3, k >= 1): text", false).as_deref(), Some("ZED-4"));
    assert_eq!(definition(" `ZED-5`: text", true).as_deref(), Some("ZED-5"));
    // Citations: no colon, inside a sentence, a continuation line, unmatched emphasis.
    assert_eq!(definition(" - ZED-1 and ZED-2", false), None);
    assert_eq!(definition(" see ZED-1: text", true), None);
    assert_eq!(definition(" ZED-1: text", false), None);
    assert_eq!(definition(" - **ZED-1: text", false), None);
    assert_eq!(definition(" - SHA-256: text", false), None);

    let src = "//! Title.\n//!\n//! - ZED-1: a\n//!   ZED-9: continued\n//! `QUX-1`: b\n\
               //!\n//! `QUX-2`: c\n/// - ZED-2: d\n/// ZED-3: cites\n//// - ZED-4: no\n\
               let s = \"//! - ZED-5: a string\";\n// - ZED-6: plain comment\n";
    let got = definitions(src, &classify(src));
    assert_eq!(got, [(3, "ZED-1".to_string()), (7, "QUX-2".to_string()), (8, "ZED-2".to_string())]);
}

#[test]
fn lexer_tells_code_from_comments_and_literals() {
    let src = "a /* b /* c */ d */ e \"f\\\"}\" r#\"g\"}\"# 'h' '\\n' 'i '{' // j\nk";
    let k = classify(src);
    let code: String =
        src.char_indices().filter(|(i, _)| k[*i] == Kind::Code).map(|(_, c)| c).collect();
    assert_eq!(code.split_whitespace().collect::<Vec<_>>(), ["a", "e", "'i", "k"]);
    let src = "fn f<'a>(x: &'a str) -> char { 'é' }";
    let k = classify(src);
    assert_eq!(close_of(src, &k, src.find('{').unwrap()), Some(src.len()));
}

#[test]
fn test_code_is_cfg_test_items_and_test_functions() {
    let src = "\
//! Doc.
fn lib() { let _ = \"#[test]\"; }

/// Cites ZED-1.
#[test]
#[ignore]
fn t() { if true { } }

#[cfg(test)]
#[allow(dead_code)]
mod tests { fn h() { let _ = \"}\"; } }

#[cfg(test)]
pub(crate) mod sim;
mod other;
";
    let l = test_layout(src);
    let text: Vec<&str> = l.regions.iter().map(|&(a, e)| &src[a..e]).collect();
    assert_eq!(text.len(), 3);
    assert!(text[0].starts_with("/// Cites ZED-1.\n#[test]") && text[0].ends_with("{ } }"));
    assert!(text[1].starts_with("#[cfg(test)]\n#[allow") && text[1].ends_with("} }"));
    assert_eq!(text[2], "#[cfg(test)]\npub(crate) mod sim;");
    assert_eq!(l.mods, [("sim".to_string(), true), ("other".to_string(), false)]);
    assert_eq!(
        child_module(Path::new("c/src/algo/mod.rs"), "sim")[0],
        Path::new("c/src/algo/sim.rs")
    );
    assert_eq!(
        child_module(Path::new("m/src/cuda.rs"), "tests")[1],
        Path::new("m/src/cuda/tests/mod.rs")
    );
    assert_eq!(
        child_module(Path::new("r/tests/x.rs"), "common")[0],
        Path::new("r/tests/common.rs")
    );
    assert_eq!(child_module(Path::new("r/src/bin/cli.rs"), "t")[0], Path::new("r/src/bin/t.rs"));
    assert!(in_tests_dir(Path::new("collectives/tests/conformance.rs")));
    assert!(in_tests_dir(Path::new("tests/tests/multinode.rs")));
    assert!(in_tests_dir(Path::new("runtime/tests/common/mod.rs")));
    assert!(!in_tests_dir(Path::new("tests/src/netns.rs")));
    assert!(!in_tests_dir(Path::new("models/src/cuda/tests.rs")));
}

#[test]
fn test_names_cite_the_ids_they_end_with() {
    let known: BTreeSet<String> = ["ZED".to_string(), "QUX".to_string()].into();
    assert_eq!(name_cites("reuses_and_bounds_zed_1_2", &known), ["ZED-1", "ZED-2"]);
    assert_eq!(name_cites("refused_qux_3", &known), ["QUX-3"]);
    assert!(name_cites("reshard_4_to_2_to_3", &known).is_empty());
    assert!(name_cites("exits_2", &known).is_empty());
    assert!(name_cites("zed_stays_put", &known).is_empty());
    assert!(name_cites("zed", &known).is_empty());
}

#[test]
fn section_references_and_headings() {
    let src = "//! The runtime (see ARCHITECTURE.md, \"runtime\").\n\
               //! [`Stage`] is the table of ARCHITECTURE.md (\"runtime / Sharding\"):\n\
               /// A plain mention of ARCHITECTURE.md.\n\
               //! Per step (ARCHITECTURE.md,\n//! \"Schedule\"):\n";
    let refs: Vec<String> = section_refs(src).into_iter().map(|(_, s)| s).collect();
    assert_eq!(refs, ["runtime", "runtime / Sharding", "Schedule"]);

    let md = "# Title\n## runtime\n### Sharding\n```\n## Fenced\n```\n### `Schedule`\n\
              ## collectives\n### Lanes\n";
    let hs = headings(md);
    assert_eq!(hs.len(), 6);
    assert!(has_section(&hs, "runtime"));
    assert!(has_section(&hs, "Schedule"));
    assert!(has_section(&hs, "runtime / Sharding"));
    assert!(has_section(&hs, "runtime / Schedule"));
    assert!(!has_section(&hs, "runtime / Lanes"));
    assert!(!has_section(&hs, "Fenced"));
    assert!(!has_section(&hs, "Sharding / runtime"));
}

#[test]
fn tables_under_a_heading() {
    let md = "## Concepts\nIntro.\n\n| concept | path |\n|---|---|\n| lane | `c/src/lane.rs`, \
              `c/src/work.rs` |\n| engine | `r/src/engine/` |\n\nAfter.\n| not | this |\n## Next\n";
    let rows = table(md, "Concepts").expect("table");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].0, 6);
    assert_eq!(backticked(&rows[0].1[1]), ["c/src/lane.rs", "c/src/work.rs"]);
    assert_eq!(backticked(&rows[1].1[1]), ["r/src/engine/"]);
    assert!(table(md, "Missing").is_none());
}

#[test]
fn every_check_on_a_small_tree() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let write = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    };
    write(
        "a/src/lib.rs",
        "//! Crate (ARCHITECTURE.md, \"Nowhere\"; see ARCHITECTURE.md, \"Concepts\").\n//!\n\
         //! - ZED-1: one.\n//! - ZED-2: two.\n//! - ZED-2: again.\n//! - ZED-3: unchecked.\n\
         #[cfg(test)]\nmod tests;\n/// Uses QUX-9.\npub fn f() {}\n",
    );
    write("a/src/tests.rs", "// ZED-1 is checked here.\n");
    write("a/tests/t.rs", "#[test]\nfn both_agree_zed_2() {}\n");
    write("target/debug/x.rs", "// QUX-8 in build output is not read.\n");
    write(
        "ARCHITECTURE.md",
        "# T\n## Concepts\n| concept | where |\n|---|---|\n| lib | `a/src/lib.rs` |\n\
         | gone | `a/src/gone.rs` |\n\n## Invariants\n| prefix | area | defined in |\n|---|---|---|\n\
         | `ZED` | z | `a/src/` |\n| `QUX` | q | `a/src/lib.rs` |\n",
    );
    let groups = problems(root, &root.join("none.rs"));
    let got: BTreeMap<&str, &Vec<String>> = groups.iter().map(|(t, v)| (t.as_str(), v)).collect();
    let one = |title: &str| -> String {
        let v = got.get(title).unwrap_or_else(|| panic!("no group {title:?} in {groups:?}"));
        assert_eq!(v.len(), 1, "{title}: {v:?}");
        v[0].clone()
    };
    assert_eq!(one("invariant defined more than once"), "ZED-2: a/src/lib.rs:4, a/src/lib.rs:5");
    assert_eq!(one("invariant cited but never defined"), "QUX-9: cited at a/src/lib.rs:9");
    assert_eq!(one("invariant defined but cited by no test"), "ZED-3: defined at a/src/lib.rs:6");
    assert!(one("path in ARCHITECTURE.md that does not exist").contains("`a/src/gone.rs`"));
    assert!(one(
        "invariant index (ARCHITECTURE.md, \"Invariants\") disagrees with the definitions"
    )
    .starts_with("QUX: indexed at ARCHITECTURE.md:12"));
    assert_eq!(
        one("reference to a section ARCHITECTURE.md does not have"),
        "a/src/lib.rs:1: \"Nowhere\""
    );
    assert_eq!(groups.len(), 6, "{groups:?}");
}
