use std::process::ExitCode;

use capi_autoscaler_provider::config::{Cli, Command};
use capi_autoscaler_provider::{check, server};
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube_runtime=warn,kube_client=warn")
    });
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("LOG_FORMAT").is_ok_and(|f| f == "json") {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    let result = match cli.command {
        None => server::run(cli.serve).await.map(|()| ExitCode::SUCCESS),
        Some(Command::Serve(args)) => server::run(args).await.map(|()| ExitCode::SUCCESS),
        Some(Command::Check(args)) => check::run(args).await,
        Some(Command::Template(args)) => check::template(args).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
