//! What `graft-serve serve --model` loads (on the CPU): every supported architecture from a
//! directory the test writes, decoding the tokens its port decodes from the same files; a
//! sharded checkpoint; a GGUF file with its tokenizer beside it; each load error; the random
//! model's tokenizer and chat templates.

#[path = "support/checkpoints.rs"]
mod checkpoints;

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use checkpoints::{PROMPT, TestResult, configs, direct, gguf, greedy, shard, spec, tiny};
use graft_candle_models::{checkpoint, quantized_llama};
use graft_serve::model::{ChatTemplate, Defaults, LoadError, Message, TemplateError, load};

#[test]
fn every_architecture_loads_and_decodes_as_its_port() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let tokenizer = tiny(tmp.path())?.join("tokenizer.json");
    for (name, config) in configs() {
        let dir = tmp.path().join(name);
        std::fs::create_dir(&dir)?;
        std::fs::write(dir.join("config.json"), &config)?;
        std::fs::copy(&tokenizer, dir.join("tokenizer.json"))?;
        let weights =
            checkpoint::random_weights(&spec(name, &config)?, 3, DType::F32, &Device::Cpu)?;
        let file = dir.join("model.safetensors");
        checkpoint::write_safetensors(&weights, &file)?;

        let loaded = load(&dir, DType::F32, &Device::Cpu)?;
        assert_eq!(loaded.architecture, name);
        assert_eq!(loaded.name, name);
        assert_eq!(loaded.max_position, Some(128));
        assert!(loaded.template.is_none());
        assert_eq!(loaded.defaults, Defaults::default());
        let ours = greedy(&loaded.decoder, &PROMPT, 24)?;
        let theirs = greedy(&direct(name, &config, &[file])?, &PROMPT, 24)?;
        assert_eq!(ours, theirs, "{name}");
        println!("{name}: {ours:?}");
        // config.json's end tokens (there is no generation_config.json or
        // tokenizer_config.json to say).
        let eos = if name == "llama" { vec![7, 9] } else { vec![] };
        assert_eq!(loaded.eos, eos, "{name}");
    }
    Ok(())
}

#[test]
fn the_random_model_loads_with_its_template_and_end_token() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tiny(tmp.path())?;
    let loaded = load(&dir, DType::F32, &Device::Cpu)?;
    assert_eq!(loaded.name, "tiny");
    assert_eq!(loaded.architecture, "llama");
    assert_eq!(loaded.eos, vec![257]);
    assert_eq!(loaded.max_position, Some(512));
    assert_eq!(loaded.decoder.spec().vocab, 258);
    assert_eq!(loaded.defaults, Defaults::default());
    let template = loaded
        .template
        .ok_or("the random model has a chat template")?;
    let messages = [
        message("system", "Be brief."),
        message("user", "Hi, ünïcode ✓"),
    ];
    assert_eq!(
        template.render(&messages, true)?,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi, ünïcode ✓<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        template.render(&messages[..1], false)?,
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    );
    Ok(())
}

#[test]
fn the_random_tokenizer_round_trips_any_text() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tiny(tmp.path())?;
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))?;
    assert_eq!(tokenizer.get_vocab_size(true), 258);
    assert_eq!(tokenizer.token_to_id("<s>"), Some(256));
    assert_eq!(tokenizer.token_to_id("</s>"), Some(257));
    let ids = tokenizer.encode("A b", false)?.get_ids().to_vec();
    assert_eq!(ids, vec![65, 32, 98], "a token per byte, its id the byte");
    let mut texts: Vec<String> = [
        "",
        "hello world",
        "  leading and trailing spaces \n\t\r\n",
        "héllo wörld, naïve café",
        "日本語のテキスト 🦀🚀 Ελληνικά русский",
        "<|im_start|>user\nhi<|im_end|> <unused5>",
        "\u{0}\u{7f}\u{80}\u{ffff}\u{10ffff}",
    ]
    .map(String::from)
    .to_vec();
    // Pseudo-random text over all of Unicode's scalar values.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for _ in 0..50 {
        let text: String = (0..40)
            .filter_map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                let range = if state >> 63 == 0 { 0x80 } else { 0x11_0000 };
                char::from_u32(((state >> 32) % range) as u32)
            })
            .collect();
        texts.push(text);
    }
    for text in &texts {
        let ids = tokenizer.encode(text.as_str(), false)?.get_ids().to_vec();
        assert_eq!(ids.len(), text.len(), "{text:?}: one token per byte");
        assert!(ids.iter().all(|&id| id < 256), "{text:?}: {ids:?}");
        assert_eq!(&tokenizer.decode(&ids, false)?, text);
    }
    let ids = tokenizer.encode("<s>hi</s>", false)?.get_ids().to_vec();
    assert_eq!(ids, vec![256, 104, 105, 257]);
    assert_eq!(tokenizer.decode(&ids, true)?, "hi");
    Ok(())
}

#[test]
fn a_sharded_checkpoint_loads_by_its_index_or_by_its_files() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tiny(tmp.path())?;
    let whole = greedy(&load(&dir, DType::F32, &Device::Cpu)?.decoder, &PROMPT, 16)?;
    shard(&dir)?;
    let indexed = greedy(&load(&dir, DType::F32, &Device::Cpu)?.decoder, &PROMPT, 16)?;
    assert_eq!(indexed, whole);
    std::fs::remove_file(dir.join("model.safetensors.index.json"))?;
    let globbed = greedy(&load(&dir, DType::F32, &Device::Cpu)?.decoder, &PROMPT, 16)?;
    assert_eq!(globbed, whole);
    println!("sharded: {whole:?}");
    // An index naming a shard that is not there.
    shard_missing(&dir)
}

fn shard_missing(dir: &Path) -> TestResult {
    let index = r#"{"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}"#;
    std::fs::write(dir.join("model.safetensors.index.json"), index)?;
    match load(dir, DType::F32, &Device::Cpu) {
        Err(LoadError::Missing { path, .. }) => {
            assert!(
                path.ends_with("model-00009-of-00009.safetensors"),
                "{path:?}"
            );
            Ok(())
        }
        other => Err(format!("expected a missing shard, got {other:?}").into()),
    }
}

#[test]
fn a_gguf_file_loads_with_the_tokenizer_beside_it() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let tokenizer = tiny(tmp.path())?.join("tokenizer.json");
    let dir = tmp.path().join("gguf");
    std::fs::create_dir(&dir)?;
    let path = dir.join("small-q8.gguf");
    let template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}";
    gguf(
        &path,
        &[
            (
                "tokenizer.chat_template",
                gguf_file::Value::String(template.into()),
            ),
            ("tokenizer.ggml.bos_token_id", gguf_file::Value::U32(256)),
            ("tokenizer.ggml.eos_token_id", gguf_file::Value::U32(257)),
        ],
    )?;
    match load(&path, DType::F32, &Device::Cpu) {
        Err(LoadError::GgufTokenizer { path: p }) => assert_eq!(p, dir.join("tokenizer.json")),
        other => return Err(format!("expected no tokenizer, got {other:?}").into()),
    }
    std::fs::copy(&tokenizer, dir.join("tokenizer.json"))?;
    let loaded = load(&path, DType::BF16, &Device::Cpu)?;
    assert_eq!(loaded.name, "small-q8");
    assert_eq!(loaded.architecture, "quantized_llama");
    assert_eq!(loaded.eos, vec![257]);
    assert_eq!(loaded.max_position, Some(128));
    let rendered = loaded
        .template
        .as_ref()
        .ok_or("the gguf file has a chat template")?
        .render(&[message("user", "hi")], true)?;
    assert_eq!(rendered, "<s>[user] hi</s>");
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let theirs = quantized_llama::load(&content, &mut file, &Device::Cpu)?;
    let ours = greedy(&loaded.decoder, &PROMPT, 16)?;
    assert_eq!(ours, greedy(&theirs, &PROMPT, 16)?);
    println!("gguf: {ours:?}");
    Ok(())
}

/// The error loading `path`, or a failure if it loads.
fn load_err(path: &Path) -> TestResult<LoadError> {
    match load(path, DType::F32, &Device::Cpu) {
        Ok(_) => Err(format!("{} loaded", path.display()).into()),
        Err(e) => Ok(e),
    }
}

/// Checks `e`'s message names `path`.
fn names(e: &LoadError, path: &Path) {
    let shown = e.to_string();
    assert!(shown.contains(&path.display().to_string()), "{shown}");
    println!("{shown}");
}

#[test]
fn each_missing_or_bad_file_is_its_own_error() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tiny(tmp.path())?;

    let nowhere = tmp.path().join("nowhere");
    let e = load_err(&nowhere)?;
    assert!(
        matches!(&e, LoadError::Missing { path, .. } if *path == nowhere),
        "{e:?}"
    );
    names(&e, &nowhere);
    let text = tmp.path().join("notes.txt");
    std::fs::write(&text, "hi")?;
    let e = load_err(&text)?;
    assert!(matches!(e, LoadError::NotAModel { .. }), "{e:?}");
    names(&e, &text);

    for (file, what) in [
        ("model.safetensors", "weights"),
        ("tokenizer.json", "tokenizer"),
        ("config.json", "architecture"),
    ] {
        let path = dir.join(file);
        let kept = std::fs::read(&path)?;
        std::fs::remove_file(&path)?;
        let e = load_err(&dir)?;
        match &e {
            LoadError::Missing { path: p, what: w } => {
                assert_eq!(*p, path);
                assert!(w.contains(what), "{w}");
            }
            other => return Err(format!("{file}: expected missing, got {other:?}").into()),
        }
        names(&e, &path);
        std::fs::write(&path, kept)?;
    }

    let config_path = dir.join("config.json");
    let config = std::fs::read_to_string(&config_path)?;
    let gpt2 = config
        .replace("LlamaForCausalLM", "GPT2LMHeadModel")
        .replace("\"llama\"", "\"gpt2\"");
    std::fs::write(&config_path, gpt2)?;
    let e = load_err(&dir)?;
    match &e {
        LoadError::UnknownArchitecture {
            found, supported, ..
        } => {
            assert_eq!(found, "GPT2LMHeadModel");
            assert!(supported.contains("Qwen3MoeForCausalLM"), "{supported}");
        }
        other => return Err(format!("expected an unknown architecture, got {other:?}").into()),
    }
    names(&e, &config_path);
    std::fs::write(
        &config_path,
        config.replace("\"hidden_size\"", "\"hidden\""),
    )?;
    let e = load_err(&dir)?;
    assert!(
        matches!(
            e,
            LoadError::Config {
                architecture: "llama",
                ..
            }
        ),
        "{e:?}"
    );
    names(&e, &config_path);
    std::fs::write(
        &config_path,
        config.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"),
    )?;
    let e = load_err(&dir)?;
    assert!(
        matches!(
            e,
            LoadError::Weights {
                architecture: "llama",
                ..
            }
        ),
        "{e:?}"
    );
    names(&e, &dir);
    std::fs::write(&config_path, &config)?;

    for file in [
        "config.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let path = dir.join(file);
        let kept = std::fs::read(&path)?;
        std::fs::write(&path, "{\"not json")?;
        let e = load_err(&dir)?;
        assert!(
            matches!(&e, LoadError::Json { path: p, .. } if *p == path),
            "{e:?}"
        );
        names(&e, &path);
        std::fs::write(&path, kept)?;
    }
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, "{}")?;
    let e = load_err(&dir)?;
    assert!(matches!(e, LoadError::Tokenizer { .. }), "{e:?}");
    names(&e, &path);
    Ok(())
}

/// Rewrites `dir`'s `file` (JSON) by `edit`.
fn edit_json(dir: &Path, file: &str, edit: impl FnOnce(&mut serde_json::Value)) -> TestResult {
    let path = dir.join(file);
    let mut value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    edit(&mut value);
    std::fs::write(path, value.to_string())?;
    Ok(())
}

#[test]
fn templates_defaults_and_end_tokens_come_from_the_configs() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tiny(tmp.path())?;
    let generation = r#"{"eos_token_id": [257, 3], "do_sample": true, "temperature": 0.6,
        "top_p": 0.9, "top_k": 20, "max_new_tokens": 100}"#;
    std::fs::write(dir.join("generation_config.json"), generation)?;
    edit_json(&dir, "tokenizer_config.json", |v| {
        v["bos_token"] = serde_json::json!({"content": "<s>", "special": true});
        v["chat_template"] = serde_json::json!([
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
        ]);
    })?;
    let loaded = load(&dir, DType::F32, &Device::Cpu)?;
    let defaults = Defaults {
        temperature: Some(0.6),
        top_p: Some(0.9),
        top_k: Some(20),
        max_new_tokens: Some(100),
    };
    assert_eq!(loaded.defaults, defaults);
    assert_eq!(loaded.eos, vec![257, 3]);
    let template = loaded.template.ok_or("a default template")?;
    assert_eq!(template.render(&[message("user", "x")], false)?, "<s>x");

    // do_sample false: greedy; no eos_token_id there: config.json's.
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"do_sample": false, "temperature": 0.6, "top_k": 5}"#,
    )?;
    let loaded = load(&dir, DType::F32, &Device::Cpu)?;
    assert_eq!(loaded.defaults.temperature, Some(0.0));
    assert_eq!((loaded.defaults.top_p, loaded.defaults.top_k), (None, None));
    assert_eq!(loaded.eos, vec![257]);
    // Neither file has one: tokenizer_config.json's eos_token, looked up.
    edit_json(&dir, "config.json", |v| {
        v["eos_token_id"] = serde_json::Value::Null
    })?;
    edit_json(&dir, "tokenizer_config.json", |v| {
        v["eos_token"] = "<s>".into()
    })?;
    assert_eq!(load(&dir, DType::F32, &Device::Cpu)?.eos, vec![256]);

    edit_json(&dir, "tokenizer_config.json", |v| {
        v["chat_template"] = serde_json::json!([{"name": "tool_use", "template": "x"}]);
    })?;
    let e = load_err(&dir)?;
    assert!(
        matches!(&e, LoadError::NoDefaultTemplate { names, .. } if names == &["tool_use"]),
        "{e:?}"
    );
    edit_json(&dir, "tokenizer_config.json", |v| {
        v["chat_template"] = "{% for %}".into()
    })?;
    let e = load_err(&dir)?;
    assert!(
        matches!(
            &e,
            LoadError::Template {
                source: TemplateError::Compile { .. },
                ..
            }
        ),
        "{e:?}"
    );
    names(&e, &dir.join("tokenizer_config.json"));
    Ok(())
}

fn message(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}

/// Llama 3's template, trimmed, with what real templates call: `bos_token`, `| trim`,
/// `.strip()`, `raise_exception`, `tojson`, `strftime_now`, `namespace` and slices.
const LLAMA3: &str = r#"{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\n" }}
{{- system + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Unsupported role: " + message['role']) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'].strip() + '<|eot_id|>' }}
{%- endfor %}
{{- "turns=" + ns.turns|string + " json=" + {"role": messages[0].role, "n": [1, 2]}|tojson }}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

#[test]
fn a_llama3_style_template_renders_and_raises() -> TestResult {
    let template = ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>"), Some("<|eot_id|>"))?;
    let messages = [
        message("system", "  Be brief.\n"),
        message("user", "\n Hi there  "),
        message("assistant", "Hello."),
    ];
    let rendered = template.render(&messages, true)?;
    println!("{rendered}");
    let (head, date_and_rest) = rendered
        .split_once("Today Date: ")
        .ok_or("the template writes the date")?;
    assert_eq!(
        head,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    );
    let (date, rest) = date_and_rest.split_once('\n').ok_or("a line of date")?;
    let parts: Vec<&str> = date.split(' ').collect();
    assert!(
        parts.len() == 3 && parts[0].len() == 2 && parts[1].len() == 3 && parts[2].len() == 4,
        "{date}"
    );
    assert_eq!(
        rest,
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\
         turns=2 json={\"n\": [1, 2], \"role\": \"user\"}\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let bad = [message("user", "hi"), message("tool", "42")];
    match template.render(&bad, false) {
        Err(TemplateError::Raised { message }) => assert_eq!(message, "Unsupported role: tool"),
        other => return Err(format!("expected the template to raise, got {other:?}").into()),
    }
    let e = template
        .render(&bad, false)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rejected the messages: Unsupported role: tool"),
        "{e}"
    );
    let indented = ChatTemplate::new("{{ messages[0] | tojson(indent=2) }}", None, None)?;
    assert_eq!(
        indented.render(&bad, false)?,
        "{\n  \"role\": \"user\",\n  \"content\": \"hi\"\n}"
    );
    // A template's own mistake is a rendering error; bad syntax does not compile.
    let t = ChatTemplate::new("{{ messages[0].content.no_such_method() }}", None, None)?;
    let e = t.render(&bad, false);
    assert!(matches!(e, Err(TemplateError::Render { .. })), "{e:?}");
    let e = ChatTemplate::new("{% if %}", None, None);
    assert!(matches!(e, Err(TemplateError::Compile { .. })), "{e:?}");
    Ok(())
}

#[test]
fn what_a_server_shares_across_threads_can_be_shared() {
    fn shared<T: Send + Sync>() {}
    fn sent<T: Send>() {}
    shared::<ChatTemplate>();
    shared::<TemplateError>();
    shared::<LoadError>();
    sent::<graft_serve::model::Loaded>();
}
