//! Chat-template behaviour that transformers' Jinja environment has and minijinja's defaults
//! don't. Expected strings are what transformers 4.57.3 renders (checked by hand with
//! `apply_chat_template(..., chat_template=src, tokenize=False)`); byte-level agreement on real
//! model templates is covered by tests/tokenizer_reference.rs.

use quiver_model::chat::{ChatMessage, ChatTemplate};

fn render(src: &str, msgs: &[ChatMessage], agp: bool) -> anyhow::Result<String> {
    ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))?.render(msgs, agp)
}

fn user(c: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", c)]
}

#[test]
fn chat_tojson_is_python_json_dumps() {
    let msgs = user("a<b>&'\"é😀\n");
    // No HTML escaping, Python separators, keys in insertion order, non-ASCII kept.
    assert_eq!(
        render("{{ messages | tojson }}", &msgs, false).unwrap(),
        r#"[{"role": "user", "content": "a<b>&'\"é😀\n"}]"#
    );
    assert_eq!(
        render("{{ messages[0] | tojson(indent=2) }}", &msgs, false).unwrap(),
        "{\n  \"role\": \"user\",\n  \"content\": \"a<b>&'\\\"é😀\\n\"\n}"
    );
    assert_eq!(
        render("{{ messages[0] | tojson(ensure_ascii=True, sort_keys=True) }}", &msgs, false).unwrap(),
        r#"{"content": "a<b>&'\"\u00e9\ud83d\ude00\n", "role": "user"}"#
    );
    assert_eq!(
        render("{{ messages[0] | tojson(separators=(',', ':')) }}", &user("x"), false).unwrap(),
        r#"{"role":"user","content":"x"}"#
    );
    assert_eq!(render("{{ [] | tojson(indent=4) }}|{{ {} | tojson }}", &[], false).unwrap(), "[]|{}");
    assert_eq!(render("{{ [1, 2.5, none, true] | tojson }}", &[], false).unwrap(), "[1, 2.5, null, true]");
}

#[test]
fn chat_python_printing_and_methods() {
    assert_eq!(render("{{ true }} {{ false }} {{ none }}", &[], false).unwrap(), "True False None");
    assert_eq!(
        render("{{ messages[0].content.strip().split(',') | join('|') }}", &user("  a,b ,c  "), false).unwrap(),
        "a|b |c"
    );
    assert_eq!(render("{{ 'abc'.startswith('a') }}{{ 'Ab'.lower() }}", &[], false).unwrap(), "Trueab");
}

#[test]
fn chat_whitespace_control_like_transformers() {
    // trim_blocks eats the newline after a tag, lstrip_blocks the indentation before it, and
    // the template's single trailing newline is dropped (keep_trailing_newline=False).
    let src =
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
    assert_eq!(
        render(src, &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")], false).unwrap(),
        "[a]\n[b]\n"
    );
}

#[test]
fn chat_variables_and_generation_prompt() {
    let src = "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";
    assert_eq!(render(src, &user("hi"), true).unwrap(), "<s>user:hi</s>assistant:");
    assert_eq!(render(src, &user("hi"), false).unwrap(), "<s>user:hi</s>");
    // An absent special token is undefined (renders empty, `is defined` is false), as in HF.
    let t = ChatTemplate::new("[{{ bos_token }}]{{ eos_token is defined }}", None, None).unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "[]False");
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), serde_json::json!([{"name": "f"}]));
    let t = ChatTemplate::new("{{ tools | tojson }}", None, None).unwrap();
    assert_eq!(t.render_with(&[], false, extra).unwrap(), r#"[{"name": "f"}]"#);
}

#[test]
fn chat_raise_exception_and_errors() {
    let src = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with system') }}{% endif %}ok";
    let e = format!("{:#}", render(src, &user("x"), false).unwrap_err());
    assert!(e.contains("Conversation must start with system"), "{e}");
    assert_eq!(render(src, &[ChatMessage::new("system", "s")], false).unwrap(), "ok");
    let e = format!("{:#}", ChatTemplate::new("{% for x in %}", None, None).unwrap_err());
    assert!(e.contains("chat template"), "{e}");
}

#[test]
fn chat_strftime_now_and_loop_controls() {
    let year = render("{{ strftime_now('%Y') }}", &[], false).unwrap();
    assert_eq!(year.len(), 4);
    assert!(year.parse::<u32>().unwrap() >= 2024);
    assert!(render("{{ strftime_now('%Q') }}", &[], false).is_err());
    let src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}";
    let msgs = ["system", "user", "assistant", "user"].map(|r| ChatMessage::new(r, r)).to_vec();
    assert_eq!(render(src, &msgs, false).unwrap(), "user");
}

#[test]
fn chat_message_serde_roundtrip() {
    let m: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
    assert_eq!(m, ChatMessage::new("user", "hi"));
    assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"role":"user","content":"hi"}"#);
}
