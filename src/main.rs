use std::process::ExitCode;

use capi_autoscaler_provider::config::{Cli, Command};
use capi_autoscaler_provider::{check, explain, logging, print_template, server};
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    // Before the flags are read: a bad flag or environment value is a start-up error like any
    // other, logged as JSON when LOG_FORMAT=json.
    logging::init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return logging::usage_error(&e),
    };
    let result = match cli.command {
        None => server::run(cli.serve).await.map(|()| ExitCode::SUCCESS),
        Some(Command::Serve(args)) => server::run(args).await.map(|()| ExitCode::SUCCESS),
        Some(Command::Check(args)) => check::run(args).await,
        Some(Command::Template(args)) => print_template::run(args).await,
        Some(Command::Explain(args)) => explain::run(args).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            logging::fatal(&e);
            ExitCode::from(2)
        }
    }
}
