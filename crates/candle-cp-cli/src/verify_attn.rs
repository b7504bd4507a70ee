//! OWNER: to be written.
#[derive(clap::Args)]
pub struct AttnArgs {}
pub fn run(_a: AttnArgs) -> crate::Outcome {
    anyhow::bail!("not implemented yet")
}
