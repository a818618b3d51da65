//! PEFT config semantics and every refusal, each error naming the adapter and field/tensor.

mod common;

use common::*;
use quiver_kernels::DeviceKind;
use quiver_lora::{AdapterConfig, LoraAdapter, LoraConfig, LoraError, LoraManager, LoraModule};
use serde_json::json;

fn parse(v: serde_json::Value) -> Result<AdapterConfig, LoraError> {
    AdapterConfig::parse("ad", &v.to_string())
}

#[test]
fn rslora_scaling_is_alpha_over_sqrt_r() {
    let c = parse(json!({"r": 16, "lora_alpha": 32, "use_rslora": true, "target_modules": ["q_proj"]})).unwrap();
    assert_eq!(c.rank_scaling("model.layers.0.self_attn.q_proj"), (16, 8.0));
    let c = parse(json!({"r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]})).unwrap();
    assert_eq!(c.rank_scaling("model.layers.0.self_attn.q_proj"), (16, 2.0));
}

#[test]
fn rank_and_alpha_patterns_follow_peft_matching() {
    let c = parse(json!({
        "r": 8, "lora_alpha": 16, "target_modules": "all-linear",
        "rank_pattern": {"q_proj": 4, "layers.1.mlp.down_proj": 2, "model.layers.0.self_attn.k_proj": 6},
        "alpha_pattern": {"^model.layers.1.*v_proj": 3, "o_proj": 10}
    }))
    .unwrap();
    assert_eq!(c.rank_alpha("model.layers.0.self_attn.q_proj"), (4, 16.0));
    assert_eq!(c.rank_alpha("model.layers.1.mlp.down_proj"), (2, 16.0));
    assert_eq!(c.rank_alpha("model.layers.0.mlp.down_proj"), (8, 16.0));
    // Full-path key matches from the start too.
    assert_eq!(c.rank_alpha("model.layers.0.self_attn.k_proj"), (6, 16.0));
    // A key must end at a dot boundary: "q_proj" does not match "xq_proj".
    assert_eq!(c.rank_alpha("model.layers.0.self_attn.xq_proj"), (8, 16.0));
    assert_eq!(c.rank_alpha("model.layers.1.self_attn.v_proj"), (8, 3.0));
    assert_eq!(c.rank_alpha("model.layers.0.self_attn.v_proj"), (8, 16.0));
    assert_eq!(c.rank_scaling("model.layers.3.self_attn.o_proj"), (8, 1.25));
}

#[test]
fn target_modules_list_regex_all_linear_exclude_layers() {
    let c = parse(json!({"target_modules": ["q_proj", "mlp.up_proj"]})).unwrap();
    assert!(c.targets(0, LoraModule::QProj) && c.targets(3, LoraModule::UpProj));
    assert!(!c.targets(0, LoraModule::KProj) && !c.targets(0, LoraModule::LmHead));
    let c = parse(json!({"target_modules": r".*\.layers\.1\..*\.(q|v)_proj"})).unwrap();
    assert!(c.targets(1, LoraModule::QProj) && c.targets(1, LoraModule::VProj));
    assert!(!c.targets(0, LoraModule::QProj) && !c.targets(1, LoraModule::KProj));
    // Regex is a full match, not a search.
    let c = parse(json!({"target_modules": "q_proj"})).unwrap();
    assert!(!c.targets(0, LoraModule::QProj));
    let c = parse(json!({"target_modules": "all-linear", "exclude_modules": ["down_proj"]})).unwrap();
    for m in LoraModule::PROJECTIONS {
        assert_eq!(c.targets(2, m), m != LoraModule::DownProj, "{m:?}");
    }
    assert!(!c.targets(0, LoraModule::LmHead) && !c.targets(0, LoraModule::EmbedTokens));
    let c = parse(json!({"target_modules": ["q_proj", "lm_head", "embed_tokens"], "layers_to_transform": [1], "layers_pattern": "layers"})).unwrap();
    assert!(c.targets(1, LoraModule::QProj) && !c.targets(0, LoraModule::QProj));
    assert!(!c.targets(0, LoraModule::LmHead), "no layer index: not targeted, as in PEFT");
    let c = parse(json!({"target_modules": ["q_proj"], "layers_to_transform": 0})).unwrap();
    assert!(c.targets(0, LoraModule::QProj) && !c.targets(1, LoraModule::QProj));
    let c = parse(json!({"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "h"})).unwrap();
    assert!(!c.targets(0, LoraModule::QProj));
    // Absent target_modules: PEFT's Llama default.
    let c = parse(json!({})).unwrap();
    assert!(c.targets(0, LoraModule::QProj) && c.targets(0, LoraModule::VProj) && !c.targets(0, LoraModule::OProj));
    assert!(parse(json!({"fan_in_fan_out": true})).unwrap().fan_in_fan_out);
}

fn config_refusal(v: serde_json::Value, field: &str) {
    match parse(v) {
        Err(e @ LoraError::Config { .. }) => {
            let s = e.to_string();
            assert!(s.contains("`ad`") && s.contains(field), "{s}");
        }
        other => panic!("expected a refusal naming {field}, got {other:?}"),
    }
}

#[test]
fn config_refusals_name_the_field() {
    config_refusal(json!({"use_dora": true}), "use_dora");
    config_refusal(json!({"modules_to_save": ["lm_head"]}), "modules_to_save");
    config_refusal(json!({"bias": "all"}), "bias");
    config_refusal(json!({"bias": "lora_only"}), "bias");
    config_refusal(json!({"peft_type": "PREFIX_TUNING"}), "peft_type");
    config_refusal(json!({"layer_replication": [[0, 2]]}), "layer_replication");
    config_refusal(json!({"lora_bias": true}), "lora_bias");
    config_refusal(json!({"r": 0}), "r");
    config_refusal(json!({"rank_pattern": {"q_proj": "x"}}), "rank_pattern");
    assert!(parse(json!({"modules_to_save": null, "use_dora": false, "bias": "none"})).is_ok());
}

fn load_err(dir: &std::path::Path) -> String {
    match LoraAdapter::load("ad", dir, &DIMS) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected a refusal"),
    }
}

fn one_module(r: usize, a_shape: [usize; 2], b_shape: [usize; 2], fill: f32, cfg: serde_json::Value) -> std::path::PathBuf {
    let dir = temp_dir("bad");
    let (an, bn) = tensor_names(LoraModule::QProj, 0);
    let mut c = json!({"r": r, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_to_transform": [0]});
    if let serde_json::Value::Object(e) = cfg {
        for (k, v) in e {
            c[k] = v;
        }
    }
    write_adapter(
        &dir,
        &c,
        &[
            T { name: an, shape: a_shape.to_vec(), data: vec![fill; a_shape[0] * a_shape[1]] },
            T { name: bn, shape: b_shape.to_vec(), data: vec![0.1; b_shape[0] * b_shape[1]] },
        ],
    );
    dir
}

#[test]
fn load_refusals_name_tensor_or_file() {
    let h = DIMS.hidden;
    let q = DIMS.q_out;
    // Valid baseline, and names without the base_model.model. prefix.
    LoraAdapter::load("ad", &one_module(4, [4, h], [q, 4], 0.1, json!({})), &DIMS).unwrap();
    let s = load_err(&one_module(4, [h, 4], [q, 4], 0.1, json!({})));
    assert!(s.contains("lora_A") && s.contains("transposed"), "{s}");
    let s = load_err(&one_module(4, [4, h], [4, q], 0.1, json!({})));
    assert!(s.contains("lora_B") && s.contains("transposed"), "{s}");
    let s = load_err(&one_module(4, [6, h], [q, 6], 0.1, json!({})));
    assert!(s.contains("lora_A") && s.contains("r=4"), "{s}");
    let s = load_err(&one_module(4, [4, h], [q, 4], f32::NAN, json!({})));
    assert!(s.contains("lora_A") && s.contains("non-finite"), "{s}");
    let s = load_err(&one_module(4, [4, h], [q, 4], f32::INFINITY, json!({})));
    assert!(s.contains("non-finite"), "{s}");
    // Config targets layer 1 too, whose tensors are absent.
    let d = one_module(4, [4, h], [q, 4], 0.1, json!({"layers_to_transform": null}));
    let s = load_err(&d);
    assert!(s.contains("model.layers.1.self_attn.q_proj.lora_A.weight") && s.contains("missing"), "{s}");
    // Tensor for a module the config does not target.
    let d = one_module(4, [4, h], [q, 4], 0.1, json!({"target_modules": ["k_proj"]}));
    assert!(load_err(&d).contains("not targeted"));
    // Empty and corrupt weight files.
    let d = one_module(4, [4, h], [q, 4], 0.1, json!({}));
    std::fs::write(d.join("adapter_model.safetensors"), b"").unwrap();
    let s = load_err(&d);
    assert!(s.contains("adapter_model.safetensors") && s.contains("empty"), "{s}");
    std::fs::write(d.join("adapter_model.safetensors"), b"garbage!garbage!").unwrap();
    assert!(load_err(&d).contains("not a valid safetensors"));
    // .bin only.
    std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap();
    std::fs::write(d.join("adapter_model.bin"), b"pickle").unwrap();
    let s = load_err(&d);
    assert!(s.contains("adapter_model.bin") && s.contains("safetensors"), "{s}");
    // Added tokens.
    let d = one_module(4, [4, h], [q, 4], 0.1, json!({}));
    std::fs::write(d.join("added_tokens.json"), r#"{"<extra>": 53}"#).unwrap();
    assert!(load_err(&d).contains("added_tokens.json"));
    // DoRA through the loader names the field and the adapter.
    let d = one_module(4, [4, h], [q, 4], 0.1, json!({"use_dora": true}));
    let s = load_err(&d);
    assert!(s.contains("`ad`") && s.contains("use_dora"), "{s}");
    // Unknown tensor name.
    let d = temp_dir("unknown");
    write_adapter(&d, &json!({"r": 2, "target_modules": ["q_proj"]}), &[T { name: "base_model.model.model.norm.weight".into(), shape: vec![1, h], data: vec![1.0; h] }]);
    let s = load_err(&d);
    assert!(s.contains("model.norm.weight") && s.contains("unknown tensor"), "{s}");
    // Missing directory / config.
    assert!(load_err(&temp_dir("empty")).contains("adapter_config.json"));
}

#[test]
fn unprefixed_names_and_rank_pattern_tensors_load() {
    let dir = temp_dir("nopfx");
    let (h, q, kv) = (DIMS.hidden, DIMS.q_out, DIMS.kv_out);
    write_adapter(
        &dir,
        &json!({"r": 4, "lora_alpha": 8, "use_rslora": true, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1], "rank_pattern": {"v_proj": 2}}),
        &[
            T { name: "model.layers.1.self_attn.q_proj.lora_A.weight".into(), shape: vec![4, h], data: vec![0.1; 4 * h] },
            T { name: "model.layers.1.self_attn.q_proj.lora_B.weight".into(), shape: vec![q, 4], data: vec![0.1; 4 * q] },
            T { name: "model.layers.1.self_attn.v_proj.lora_A.weight".into(), shape: vec![2, h], data: vec![0.1; 2 * h] },
            T { name: "model.layers.1.self_attn.v_proj.lora_B.weight".into(), shape: vec![kv, 2], data: vec![0.1; 2 * kv] },
        ],
    );
    let a = LoraAdapter::load("x", &dir, &DIMS).unwrap();
    assert!(a.module(0, LoraModule::QProj).is_none());
    assert_eq!(a.module(1, LoraModule::QProj).unwrap().scaling, 4.0);
    let v = a.module(1, LoraModule::VProj).unwrap();
    assert_eq!((v.rank, v.scaling), (2, 8.0 / 2f32.sqrt()));
}

#[test]
fn pool_incompatibility_names_adapter_and_module() {
    let cfg = LoraConfig { max_lora_rank: 4, target_modules: vec![LoraModule::QProj, LoraModule::VProj], ..Default::default() };
    let mut mgr = LoraManager::new(DIMS, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let e = mgr.load_adapter("big", simple_adapter("r", 1, 8, &[LoraModule::QProj])).unwrap_err().to_string();
    assert!(e.contains("`big`") && e.contains("q_proj") && e.contains("max_lora_rank"), "{e}");
    let e = mgr.load_adapter("mlp", simple_adapter("m", 2, 4, &[LoraModule::DownProj])).unwrap_err().to_string();
    assert!(e.contains("`mlp`") && e.contains("down_proj") && e.contains("target modules"), "{e}");
    mgr.load_adapter("ok", simple_adapter("ok", 3, 4, &[LoraModule::QProj])).unwrap();
    assert!(matches!(mgr.load_adapter("ok", simple_adapter("ok", 3, 4, &[LoraModule::QProj])), Err(LoraError::AlreadyLoaded(_))));
}

#[test]
fn backend_registry_validates_per_device() {
    use quiver_lora::{backend_names, validate_backend};
    assert_eq!(backend_names(DeviceKind::Cpu), vec!["auto", "segmented", "chunked", "reference"]);
    assert!(validate_backend("chunked", DeviceKind::Cpu).is_ok());
    let e = validate_backend("triton", DeviceKind::Cpu).unwrap_err();
    assert!(e.contains("triton") && e.contains("auto, segmented, chunked, reference"), "{e}");
    // CUDA runs the policies on its own kernels; the host-memory oracle is CPU only.
    assert_eq!(backend_names(DeviceKind::Cuda(0)), vec!["auto", "segmented", "chunked"]);
    assert!(validate_backend("chunked", DeviceKind::Cuda(0)).is_ok());
    let e = validate_backend("reference", DeviceKind::Cuda(0)).unwrap_err();
    assert!(e.contains("`reference` does not support device cuda:0") && e.contains("auto, segmented, chunked"), "{e}");
    let cfg = LoraConfig { backend: "nope".into(), ..Default::default() };
    assert!(LoraManager::new(DIMS, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).is_err());
}
