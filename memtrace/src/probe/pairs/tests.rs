//! Tests of [`super`]: the TOML forms, the presets, the errors (one line
//! naming the line), and sources sharing a release function.

use super::*;

#[test]
fn presets_parse() {
    let mut index = 0;
    for (name, text) in PRESETS {
        let defs = parse(text, name, index).unwrap_or_else(|e| panic!("{e}"));
        assert!(!defs.is_empty(), "{name}");
        index += defs.len() / 2;
    }
    // Together too: no preset claims another's functions.
    let sources: Vec<(String, String)> = PRESETS
        .iter()
        .map(|(name, text)| (name.to_string(), text.to_string()))
        .collect();
    parse_sources(&sources).unwrap_or_else(|e| panic!("{e}"));
}

fn frees(defs: &[&'static FuncDef]) -> Vec<&'static str> {
    defs.iter()
        .filter(|d| d.kind == SpecKind::Free)
        .map(|d| d.name)
        .collect()
}

#[test]
fn fd_preset_covers_the_descriptor_makers_with_one_close() {
    let defs = parse(preset("fds").expect("fds"), "fds", 0).expect("parses");
    let allocs: Vec<&str> = defs
        .iter()
        .filter(|d| d.kind == SpecKind::Alloc)
        .map(|d| d.name)
        .collect();
    for name in [
        "open", "open64", "openat", "openat64", "creat", "dup", "dup2", "dup3", "socket", "accept",
        "accept4",
    ] {
        assert!(allocs.contains(&name), "{name} in {allocs:?}");
    }
    // close is declared once, and one domain holds every descriptor.
    assert_eq!(frees(&defs), ["close", "__close_nocancel"]);
    let domain = defs[0].domain;
    for def in &defs {
        assert_eq!(def.domain, domain, "{}", def.name);
        assert_eq!(def.allocator.name(), "fd");
        assert_eq!(def.quirk, SpecQuirk::Handle32);
        if def.kind == SpecKind::Alloc {
            assert_eq!(def.ret, RetKind::NonNegative, "{}", def.name);
            assert_eq!(def.size_arg, ARG_NONE);
        } else {
            assert_eq!((def.ptr_arg, def.ret), (0, RetKind::Void));
        }
    }
    let files = parse(preset("files").expect("files"), "files", 1).expect("parses");
    assert_eq!(frees(&files), ["fclose"]);
    assert!(files.iter().any(|d| d.name == "fdopen"));
    assert!(files.iter().all(|d| d.allocator.name() == "file"));
}

#[test]
fn pairs_naming_one_release_share_its_domain() {
    let text = r#"
[[pair]]
name = "file-fd"
alloc = "open"
free = "close"
handle_bits = 32
success = "nonnegative"

[[pair]]
name = "socket-fd"
alloc = ["socket", "accept"]
free = "close"
handle_bits = 32
success = "nonnegative"
"#;
    let defs = parse(text, "t.toml", 0).expect("parses");
    let names: Vec<&str> = defs.iter().map(|d| d.name).collect();
    assert_eq!(names, ["open", "close", "socket", "accept", "close"]);
    // Each pair keeps its own name and family (nesting), but both
    // closes release in the first pair's domain: probed once at one
    // address, the close releases descriptors of either pair.
    assert_eq!(defs[0].allocator.family(), FIRST_FAMILY);
    assert_eq!(defs[2].allocator.family(), FIRST_FAMILY + 1);
    assert_eq!(defs[2].allocator.name(), "socket-fd");
    assert!(defs
        .iter()
        .all(|d| d.domain == Domain::Custom(FIRST_FAMILY)));
    // Still at least two definitions per pair (callers number on by len / 2).
    assert!(defs.len() / 2 >= 2);
}

#[test]
fn a_release_is_shared_across_sources_of_one_parser() {
    let mine = "[[pair]]\nname = \"sock\"\nalloc = \"my_socket\"\nfree = \"close\"\nhandle_bits = 32\nsuccess = \"nonnegative\"\n";
    let sources = vec![
        (
            "preset fds".to_string(),
            preset("fds").expect("fds").to_string(),
        ),
        ("mine.toml".to_string(), mine.to_string()),
    ];
    let defs = parse_sources(&sources).expect("parses");
    let my_socket = defs.iter().find(|d| d.name == "my_socket").expect("mine");
    assert_eq!(my_socket.allocator.family(), FIRST_FAMILY + 1);
    assert_eq!(my_socket.domain, Domain::Custom(FIRST_FAMILY));

    let mut parser = PairsParser::new(3);
    parser.parse(mine, "a.toml").expect("parses");
    assert_eq!(parser.next_index(), 4);
    // The same alloc again is refused, and a failed source changes nothing.
    let err = parser.parse(mine, "b.toml").expect_err("claimed twice");
    assert!(err.reason.contains("already pair \"sock\"'s"), "{err}");
    assert_eq!(parser.next_index(), 4);
}

#[test]
fn shared_releases_must_agree_and_stay_releases() {
    let pair = |name: &str, alloc: &str, free: &str, extra: &str| {
        format!("[[pair]]\nname = \"{name}\"\nalloc = \"{alloc}\"\nfree = \"{free}\"\n{extra}\n")
    };
    let checked =
        pair("a", "open_a", "close", "") + &pair("b", "open_b", "close", "free_checked = true");
    let err = parse(&checked, "t.toml", 0).expect_err("disagree");
    assert!(err.reason.contains("calls it differently"), "{err}");
    let bits = pair("a", "open_a", "close", "") + &pair("b", "open_b", "close", "handle_bits = 32");
    assert!(parse(&bits, "t.toml", 0).is_err());
    let both = pair("a", "f", "f", "");
    assert!(parse(&both, "t.toml", 0)
        .expect_err("alloc and free")
        .reason
        .contains("both an alloc and a free"));
    let crossed = pair("a", "open_a", "close_a", "") + &pair("b", "close_a", "close_b", "");
    assert!(parse(&crossed, "t.toml", 0).is_err());
    let two_domains = pair("a", "open_a", "close_a", "")
        + &pair("b", "open_b", "close_b", "")
        + "[[pair]]\nname = \"c\"\nalloc = \"open_c\"\nfree = [\"close_a\", \"close_b\"]\n";
    let err = parse(&two_domains, "t.toml", 0).expect_err("two domains");
    assert_eq!(err.line, 12, "{err}");
    assert!(err.reason.contains("two other pairs"), "{err}");
    for empty in ["alloc = []", "alloc = [\"a\", \" \"]"] {
        let text = format!("[[pair]]\nname = \"x\"\n{empty}\nfree = \"f\"\n");
        let err = parse(&text, "t.toml", 0).expect_err(empty);
        assert_eq!(err.reason, "alloc is empty", "{empty}");
    }
    let wrong_type = "[[pair]]\nname = \"x\"\nalloc = 3\nfree = \"f\"\n";
    let err = parse(wrong_type, "t.toml", 0).expect_err("number");
    assert!(err.reason.contains("list of function names"), "{err}");
    // Repeats within one list are one function.
    let repeated = "[[pair]]\nname = \"x\"\nalloc = [\"a\", \"a\"]\nfree = \"f\"\n";
    assert_eq!(parse(repeated, "t.toml", 0).expect("parses").len(), 2);
}

#[test]
fn a_pair_becomes_two_probes() {
    let text = r#"
[[pair]]
name = "model"
alloc = "aclmdlLoadFromFile"
free = "aclmdlUnload"
handle = "out1"
handle_bits = 32
success = "zero"
free_checked = true
"#;
    let defs = parse(text, "test.toml", 0).expect("parses");
    assert_eq!(defs.len(), 2);
    let (alloc, free) = (defs[0], defs[1]);
    assert_eq!(alloc.name, "aclmdlLoadFromFile");
    assert_eq!(
        (alloc.out_arg, alloc.ret, alloc.quirk),
        (1, RetKind::Status, SpecQuirk::Handle32)
    );
    assert_eq!(alloc.allocator.name(), "model");
    assert_eq!(alloc.memory, Memory::Handle);
    assert_eq!(
        (free.kind, free.ptr_arg, free.ret),
        (SpecKind::Free, 0, RetKind::Status)
    );
    assert_eq!(alloc.allocator.family(), FIRST_FAMILY);
}

#[test]
fn errors_name_the_line() {
    let bad_slot = "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nhandle = \"arg9\"\n";
    let err = parse(bad_slot, "p.toml", 0).expect_err("bad slot");
    assert_eq!(err.line, 2);
    assert!(err.to_string().contains("p.toml: line 2"), "{err}");
    let syntax = "[[pair]]\nname = \"x\"\nalloc = \n";
    let err = parse(syntax, "p.toml", 0).expect_err("syntax");
    assert_eq!(err.line, 3, "{err}");
    let unknown = "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nbogus = 1\n";
    assert!(parse(unknown, "p.toml", 0).is_err());
    let success = "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nsuccess = \"maybe\"\n";
    assert!(parse(success, "p.toml", 0)
        .expect_err("success")
        .reason
        .contains("success"));
}

#[test]
fn names_are_not_empty_nor_built_in() {
    let empty = "[[pair]]\nname = \"x\"\nalloc = \"\"\nfree = \"f\"\n";
    let err = parse(empty, "p.toml", 0).expect_err("empty alloc");
    assert_eq!((err.line, err.reason.as_str()), (2, "alloc is empty"));
    let blank = "[[pair]]\nname = \" \"\nalloc = \"a\"\nfree = \"f\"\n";
    assert!(parse(blank, "p.toml", 0).is_err());
    let builtin = "[[pair]]\nname = \"cuda\"\nalloc = \"a\"\nfree = \"f\"\n";
    let err = parse(builtin, "p.toml", 0).expect_err("built-in name");
    assert!(err.reason.contains("built-in"), "{err}");
}

#[test]
fn usdt_pairs_become_probe_points() {
    let text = "[[pair]]\nname = \"torch\"\nalloc = { usdt = \"pytorch:malloc\" }\n\
                free = { usdt = [\"pytorch:free\", \"pytorch:free2\"] }\nmemory = \"device\"\n\
                handle = \"arg0\"\ndevice = \"arg1\"\nsize = \"arg2\"\nstream = \"arg3\"\n\
                free_handle = \"arg0\"\n";
    let defs = parse(text, "p.toml", 0).expect("parses");
    let names: Vec<&str> = defs.iter().map(|d| d.name).collect();
    assert_eq!(names, ["pytorch:malloc", "pytorch:free", "pytorch:free2"]);
    let alloc = defs[0];
    assert_eq!((alloc.kind, alloc.ret), (SpecKind::Alloc, RetKind::Void));
    assert_eq!(alloc.memory, Memory::Device);
    let point = alloc.usdt.expect("a USDT point");
    assert_eq!((point.provider, point.probe), ("pytorch", "malloc"));
    assert_eq!(
        (
            point.ptr_arg,
            point.tag_arg,
            point.size_arg,
            point.aux_arg,
            point.estimate
        ),
        (0, 1, 2, 3, false)
    );
    let free = defs[2].usdt.expect("a USDT point");
    assert_eq!(defs[2].kind, SpecKind::Free);
    assert_eq!(
        (free.probe, free.ptr_arg, free.size_arg),
        ("free2", 0, ARG_NONE)
    );
    assert_eq!(defs[0].domain, defs[1].domain);
    // A sampler's weight: the size is an estimate.
    let otel = preset("otel-memory").expect("preset");
    let defs = parse(otel, "otel", 0).expect("parses");
    let point = defs[0].usdt.expect("a USDT point");
    assert_eq!((point.size_arg, point.estimate), (2, true));
    assert_eq!(defs[0].memory, Memory::Host);
}

#[test]
fn malformed_usdt_pairs_are_errors_naming_the_line() {
    let pair = |body: &str| format!("[[pair]]\nname = \"u\"\n{body}\n");
    for (body, needle) in [
        ("alloc = { usdt = \"p\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"", "provider:name"),
        ("alloc = { usdt = \"p:a:b\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"", "provider:name"),
        ("alloc = { usdt = \":a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"", "provider:name"),
        ("alloc = { usdt = \"p:a\" }\nfree = \"f\"\nhandle = \"arg0\"", "both be USDT"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }", "needs handle"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"return\"", "argN"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg12\"", "0 to 11"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"\nsize = \"arg1\"\nweight = \"arg2\"", "exclude"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"\nmemory = \"gpu\"", "memory"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"\nfree_checked = true", "free_checked"),
        ("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:a\" }\nhandle = \"arg0\"", "already"),
        ("alloc = \"a\"\nfree = \"f\"\ndevice = \"arg1\"", "USDT pairs only"),
        ("alloc = { usd = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"", "usdt"),
    ] {
        let err = parse(&pair(body), "p.toml", 0).expect_err(body);
        assert!(err.to_string().contains(needle), "{body}: {err}");
        assert!(err.to_string().starts_with("p.toml: line "), "{err}");
        assert!(!err.to_string().contains('\n'), "one line: {err}");
    }
    // Two sources naming one probe.
    let one = pair("alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"");
    let sources = [("a".to_string(), one.clone()), ("b".to_string(), one)];
    assert!(parse_sources(&sources).is_err());
}
