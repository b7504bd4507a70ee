//! OWNER: to be written.
#[derive(clap::Args)]
pub struct PlanArgs {}
pub fn run(_a: PlanArgs) -> crate::Outcome {
    anyhow::bail!("not implemented yet")
}
