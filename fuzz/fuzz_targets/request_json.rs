//! Any request body must parse or be refused with an `ApiError` in OpenAI's shape, whichever
//! route it is sent to: never a panic. A refusal is a 4xx that names a field or the body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quiver_server::request::{parse_chat, parse_completion, parse_generate, resolve_model_ref, ModelRef};

fuzz_target!(|data: &[u8]| {
    let served = ["base".to_string()];
    let check = |e: quiver_server::ApiError| {
        assert!(e.status.is_client_error(), "{e}");
        let _ = e.body();
    };
    match parse_completion(data) {
        Ok(r) => {
            if let ModelRef::Adapter(a) = resolve_model_ref(r.model.as_deref(), r.lora_path.as_deref(), &served) {
                let _ = quiver_server::limits::adapter_name_error(&a);
            }
        }
        Err(e) => check(e),
    }
    if let Err(e) = parse_chat(data) {
        check(e);
    }
    if let Err(e) = parse_generate(data) {
        check(e);
    }
});
