//! Unit tests of [`super::document_ends`] and the reward model's config checks.
use super::*;

/// Each chosen document's last token carries its slot + 1 (row-major over the rows), the
/// others 0; rows whose documents do not cover `t` are refused.
#[test]
fn document_ends_mark_each_documents_last_token() -> Result<()> {
    let docs = [Documents::from_lengths(&[3, 2, 3])?, Documents::from_lengths(&[1, 7])?];
    let mut next = 0u32;
    // (every document but the last of row 0, the padding: slots 0, 1, 2, 3)
    let ends = document_ends(&docs, 8, |b, d| {
        (!(b == 0 && d == 2)).then(|| {
            next += 1;
            next - 1
        })
    })?;
    assert_eq!(ends.to_vec2::<u32>()?, [[0, 0, 1, 0, 2, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 4]]);
    assert!(document_ends(&docs, 9, |_, _| Some(0)).unwrap_err().to_string().contains("cover 8 tokens, rows are 9"));
    Ok(())
}

#[test]
fn reward_model_configs_are_checked() {
    let c = LlamaConfig::tiny(64, 32, 1, 4, 2);
    assert!(c.clone().with_num_labels(Some(1)).validate().is_ok());
    assert!(c.clone().with_num_labels(Some(0)).validate().unwrap_err().to_string().contains("at least one label"));
    let lora = crate::LoraSpec::new(4, 8.0, &["q_proj"]).expect("spec");
    let rm = c.clone().with_num_labels(Some(1));
    assert!(rm.clone().with_lora(Some(lora.clone())).validate().unwrap_err().to_string().contains("add score to modules_to_save"));
    assert!(rm.clone().with_lora(Some(lora.clone().with_modules_to_save(&["score"]).expect("score"))).validate().is_ok());
    assert!(rm.with_lora(Some(lora.clone().with_modules_to_save(&["score", "lm_head"]).expect("both"))).validate().unwrap_err().to_string().contains("no lm_head"));
    assert!(c.with_lora(Some(lora.with_modules_to_save(&["score"]).expect("score"))).validate().unwrap_err().to_string().contains("only a reward model"));
}
