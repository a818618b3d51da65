//! The byte-level detokenizer (each token's bytes appended) against the window one (ids decoded
//! by `tokenizers` before and after each new token): the same text at the same tokens, over
//! random generations heavy in multi-byte characters and special tokens, for the test data's
//! tokenizers (byte-level ones take the byte path; the others must fall back to windows).

mod common;

use common::*;
use quiver_engine::text::Detok;
use quiver_model::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn run(tok: &Tokenizer, d: &mut Detok, ids: &[u32], prompt: usize) -> Vec<Option<String>> {
    let mut out: Vec<Option<String>> = (prompt + 1..=ids.len()).map(|n| d.step(tok, &ids[..n])).collect();
    out.push(d.flush(tok, ids));
    out
}

#[test]
fn byte_level_detok_emits_what_windowed_decoding_emits() {
    let mut byte_level = 0;
    for dir in ["smollm2-hf", "tiny-llama3", "tiny-qwen2", "tiny-mistral"] {
        let tok = Tokenizer::from_hf_dir(&require(&format!("ref/models/{dir}"))).unwrap();
        byte_level += usize::from(tok.token_bytes().is_some());
        let vocab = tok.inner().get_vocab_size(true) as u32;
        // Ids whose text is a piece of a multi-byte character or a special token, often.
        let awkward: Vec<u32> = (0..vocab)
            .filter(|&id| {
                let one = tok.inner().decode(&[id], false).unwrap_or_default();
                one.contains('\u{FFFD}') || !one.is_ascii() || tok.inner().get_added_tokens_decoder().contains_key(&id)
            })
            .collect();
        let mut rng = StdRng::seed_from_u64(0xdec0);
        for round in 0..300 {
            let prompt = rng.random_range(0..6);
            let len = prompt + rng.random_range(1..40);
            let ids: Vec<u32> = (0..len).map(|_| if !awkward.is_empty() && rng.random_bool(0.5) { awkward[rng.random_range(0..awkward.len())] } else { rng.random_range(0..vocab) }).collect();
            for skip in [false, true] {
                let fast = run(&tok, &mut Detok::new(prompt, skip), &ids, prompt);
                let slow = run(&tok, &mut Detok::windowed(prompt, skip), &ids, prompt);
                assert_eq!(fast, slow, "{dir} round {round} skip_special {skip}: ids {ids:?}");
            }
        }
    }
    assert!(byte_level >= 2, "the byte-level path ran on {byte_level} tokenizers");
}
