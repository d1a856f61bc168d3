//! `template`: the scale-from-zero template Node of one node group, as CA gets it, printed as YAML;
//! when the group has none, the problems that say why.

use std::process::ExitCode;

use anyhow::Context;

use crate::config::TemplateArgs;
use crate::startup::read_only_snapshot;

/// Prints one group's template Node as YAML.
pub async fn run(args: TemplateArgs) -> anyhow::Result<ExitCode> {
    let snapshot = read_only_snapshot(&args.connection).await?;
    let group = snapshot
        .group(&args.id)
        .with_context(|| format!("no node group {:?}; `check` lists them", args.id))?;
    match &group.template {
        Some(t) => {
            print!(
                "{}",
                serde_norway::to_string(&t.node).context("encoding the template")?
            );
            Ok(ExitCode::SUCCESS)
        }
        None => {
            let object = format!("{} {}", group.kind(), group.resource.key);
            eprintln!("{} has no scale-from-zero template:", group.id);
            for p in snapshot
                .problems
                .iter()
                .filter(|p| p.object == object || p.message.contains(&object))
            {
                eprintln!("  {}: {}", p.field, p.message);
            }
            Ok(ExitCode::from(1))
        }
    }
}
