//! OWNER: to be written.
#[derive(clap::Args)]
pub struct LlamaArgs {}
pub fn run(_a: LlamaArgs) -> crate::Outcome {
    anyhow::bail!("not implemented yet")
}
