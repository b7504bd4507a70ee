//! Models whose checkpoint tensors are combinations of the model's parameters: gpt-oss's
//! experts ([`crate::config::gpt_oss`]), GraniteMoE's ([`crate::config::granite_moe`]) and
//! GLM's and GLM-4's fused MLP and q / k rows, GLM-4's norms ([`crate::config::glm4`]), read, grouped and written
//! through their modules' functions by [`crate::hf`].

use crate::config::{glm4, gpt_oss, granite_moe};
use crate::{LlamaConfig, MoeStyle};
use candle_core::{Result, Tensor};

/// Whose conversion a model's checkpoint needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Converted {
    GptOss,
    GraniteMoe,
    /// GLM or GLM-4, and `(head_dim, R)`: the rows per head and the rotated ones of q_proj and
    /// k_proj.
    Glm(glm4::Glm, (usize, usize)),
}

impl Converted {
    /// The conversion of `cfg`'s checkpoints; `None`: every parameter (a stacked expert per
    /// expert) under its own name.
    pub(crate) fn of(cfg: &LlamaConfig) -> Option<Self> {
        match () {
            _ if cfg.gpt_oss => Some(Converted::GptOss),
            _ if cfg.moe.as_ref().is_some_and(|m| m.style == MoeStyle::GraniteMoe) => Some(Converted::GraniteMoe),
            _ => cfg.glm.zip(cfg.interleaved_rope()).map(|(g, dr)| Converted::Glm(g, dr)),
        }
    }

    /// Every checkpoint tensor name parameter `name` may be read from.
    pub(crate) fn checkpoint_names(self, name: &str) -> Vec<String> {
        match self {
            Converted::GptOss => gpt_oss::checkpoint_names(name),
            Converted::GraniteMoe => vec![granite_moe::checkpoint_part(name).map_or_else(|| name.to_string(), |(ck, _)| ck)],
            Converted::Glm(g, _) => vec![glm4::checkpoint_part(g, name).map_or_else(|| name.to_string(), |(ck, _)| ck)],
        }
    }

    /// The checkpoint's tensors of the model's `tensors`, their parts grouped in part order.
    pub(crate) fn group<T>(self, tensors: Vec<(String, T)>) -> Result<Vec<(String, Vec<T>)>> {
        match self {
            Converted::GptOss => gpt_oss::group(tensors),
            Converted::GraniteMoe => granite_moe::group(tensors),
            Converted::Glm(g, _) => glm4::group(g, tensors),
        }
    }

    /// Checkpoint tensor `ck` from its `parts`.
    pub(crate) fn combine(self, ck: &str, parts: &[Tensor]) -> Result<Tensor> {
        match self {
            Converted::GptOss => gpt_oss::combine(ck, parts),
            Converted::GraniteMoe => granite_moe::combine(ck, parts),
            Converted::Glm(_, dr) => glm4::combine(ck, parts, dr),
        }
    }

    /// The shape [`Converted::combine`] gives from parts of shapes `parts`.
    pub(crate) fn combined_shape(self, ck: &str, parts: &[Vec<usize>]) -> Vec<usize> {
        match self {
            Converted::GptOss => gpt_oss::combined_shape(ck, parts),
            Converted::GraniteMoe => granite_moe::combined_shape(ck, parts),
            Converted::Glm(..) => glm4::combined_shape(ck, parts),
        }
    }

    /// Parameter `name` (full shape `shape`) from the checkpoint (`get`), `Ok(None)` for a
    /// parameter held under its own name; `cache` keeps the last fused tensor read.
    pub(crate) fn read_param(self, name: &str, shape: &[usize], get: &mut dyn FnMut(&str) -> Result<Option<Tensor>>, cache: &mut Option<(String, Tensor)>) -> Result<Option<Tensor>> {
        match self {
            Converted::GptOss => gpt_oss::from_checkpoint_cached(name, shape, get, cache),
            Converted::GraniteMoe => granite_moe::from_checkpoint_cached(name, shape, get, cache),
            Converted::Glm(g, dr) => glm4::read_param(g, name, shape, dr, get, cache),
        }
    }
}

/// Whether `cfg`'s checkpoints hold tensors combined from its parameters (gpt-oss's and
/// GraniteMoE's experts, GLM's fused MLP and permuted q / k rows): pass [`crate::save_hf_tensors`] the model's parameters by their own
/// names (stacked experts whole), not [`crate::params::checkpoint_tensors`]' per-expert ones.
pub fn converts_checkpoint(cfg: &LlamaConfig) -> bool {
    Converted::of(cfg).is_some()
}
