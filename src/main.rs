//! The `redisched` binary: parses the command line and hands over to the library.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use redisched::cli::{self, exit, Cli, Command};
use redisched::config::Config;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(exit::FAILED);
        }
    };
    ExitCode::from(runtime.block_on(async_main(cli)))
}

async fn async_main(cli: Cli) -> u8 {
    if let Command::Run = cli.command {
        return run(&cli).await;
    }
    if let Some(warning) = foreign_env_warning() {
        eprintln!("warning: {warning}");
    }
    match cli::execute(&cli).await {
        Ok(output) => {
            println!("{}", output.render(cli.json));
            exit::OK
        }
        Err(err) => {
            if cli.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&err.to_json()).unwrap_or_default()
                );
            } else {
                eprintln!("error: {err}");
            }
            err.exit_code()
        }
    }
}

/// `redisched run`: config, logging, signal handlers, then the bridge until shutdown.
async fn run(cli: &Cli) -> u8 {
    let config = match Config::load(cli.config.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("error: {}", cli::describe_config_error(&err));
            return exit::USAGE;
        }
    };
    if let Err(err) = redisched::telemetry::init(&config.log) {
        eprintln!("error: {err}");
        return exit::USAGE;
    }
    if let Some(warning) = foreign_env_warning() {
        tracing::warn!("{warning}");
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    match bridge(config, shutdown).await {
        Ok(()) => exit::OK,
        Err(err) => {
            tracing::error!(error = %err, "redisched stopped with an error");
            exit::FAILED
        }
    }
}

/// One line naming the `REDISCHED_*` variables the loader skipped (Kubernetes service
/// links and the like), so a misplaced setting does not go unnoticed.
fn foreign_env_warning() -> Option<String> {
    let names = redisched::config::foreign_env();
    (!names.is_empty()).then(|| {
        format!(
            "ignoring {} not of the REDISCHED_<SECTION>__<KEY> shape (not configuration; \
             Kubernetes sets such variables for a Service named redisched): {}",
            if names.len() == 1 {
                "a variable"
            } else {
                "variables"
            },
            names.join(", ")
        )
    })
}

async fn bridge(config: Config, shutdown: CancellationToken) -> Result<(), String> {
    redisched::app::run(config, shutdown)
        .await
        .map_err(|err| err.to_string())
}

/// The first SIGTERM or SIGINT asks for a graceful shutdown; a second one exits at once.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let mut signals = 0;
    loop {
        let name = wait_for_signal().await;
        signals += 1;
        if signals == 1 {
            tracing::info!(
                signal = name,
                "shutting down (send it again to exit at once)"
            );
            shutdown.cancel();
        } else {
            tracing::warn!(signal = name, "exiting at once");
            std::process::exit(130);
        }
    }
}

#[cfg(unix)]
async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            name = ctrl_c() => name,
        },
        Err(err) => {
            tracing::warn!(error = %err, "cannot listen for SIGTERM; only SIGINT stops redisched");
            ctrl_c().await
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() -> &'static str {
    ctrl_c().await
}

/// SIGINT; waits forever if it cannot be listened for (rather than spinning).
async fn ctrl_c() -> &'static str {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
    "SIGINT"
}
