//! The `redisched` binary: parses the command line and hands over to the library.
#![forbid(unsafe_code)]
#![warn(clippy::too_many_lines, clippy::let_underscore_must_use)]

use std::process::ExitCode;

use clap::Parser;
use redisched::cli::{self, exit, Cli, Command};
use redisched::config::Config;
use tokio_util::sync::CancellationToken;

/// mimalloc rather than glibc's malloc: fewer instructions per allocation, and a
/// webhook delivery or a dispatched job makes dozens (figures: `bench/JOURNAL.md`; the
/// memory it costs: `docs/src/deploy.md`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Stacks for the threads that handle a command's header values, which the AMQP codec
/// (lapin / amq-protocol) parses, serializes, clones and drops recursively, once per
/// nesting level. The deepest header that can arrive fits in one frame of
/// `amqp::FRAME_MAX` (131,072 bytes): ~18,700 levels of nested tables (7 bytes each) or
/// ~26,200 of nested arrays (5 bytes each). Measured cost per level (lapin 4.12.3,
/// amq-protocol 10.6.3), release / debug build: parsing 1.8 / 10.0 KB (tables), 1.5 /
/// 8.8 KB (arrays); serializing 0.6 / 4.3 KB; cloning 0.3 / 1.3 KB; dropping 0.2 / 0.7
/// KB. So parsing the deepest frame takes ~39 MB (release) or ~231 MB (debug, the
/// tests' build): lapin parses on its own thread, spawned with the default stack.
/// Stack pages are only touched when used; the rest is address space.
const PARSING_STACK: usize = if cfg!(debug_assertions) {
    384 << 20
} else {
    64 << 20
};

/// The tokio workers clone a delivery's properties (to set it aside) and drop deliveries:
/// at most ~24 MB (debug) for the deepest header; deeper than `amqp::MAX_HEADER_DEPTH`
/// the bridge's own code never encodes or walks recursively.
const WORKER_STACK: usize = 64 << 20;

fn main() -> ExitCode {
    // lapin spawns its I/O thread (which parses frames) with `std::thread::Builder` and no
    // stack size, so it gets `RUST_MIN_STACK`, read once when the first thread without
    // one is spawned: set here, before any thread exists (`set_var` is only sound then).
    // A larger value given by the user is kept; a smaller one would let one deep header
    // overflow the parser again, so it is raised.
    let given = std::env::var("RUST_MIN_STACK")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    if given.is_none_or(|given| given < PARSING_STACK) {
        std::env::set_var("RUST_MIN_STACK", PARSING_STACK.to_string());
    }
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK)
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(exit::FAILED);
        }
    };
    // On a worker, not on the main thread that `block_on` would run it on: the stages run
    // inside it (ingest drops and clones deliveries), and only workers have WORKER_STACK.
    let code = runtime.block_on(async { runtime.spawn(async_main(cli)).await });
    ExitCode::from(code.unwrap_or(exit::FAILED))
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
            if let Command::CheckConfig { .. } = cli.command {
                for warning in cli::config_warnings(cli.config.as_deref()) {
                    eprintln!("warning: {warning}");
                }
            }
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
    let telemetry = match redisched::telemetry::init(&config.log, &config.telemetry) {
        Ok(telemetry) => telemetry,
        Err(err) => {
            eprintln!("error: {err}");
            return exit::USAGE;
        }
    };
    if let Some(warning) = foreign_env_warning() {
        tracing::warn!("{warning}");
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    let code = match bridge(config, shutdown).await {
        Ok(()) => exit::OK,
        Err(err) => {
            tracing::error!(error = %err, "redisched stopped with an error");
            exit::FAILED
        }
    };
    // The spans of the last jobs are sent before the process ends.
    telemetry.shutdown().await;
    code
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
