use clap::Parser;
use gmlake_cli::app::run_replay;
use gmlake_cli::cli::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    let code = match &cli.command {
        Command::Replay(args) => run_replay(args),
        Command::TierReplay(args) => gmlake_cli::tier::run_tier_replay(args),
        Command::Ops(args) => gmlake_cli::ops::run_ops(args),
    };
    std::process::exit(code);
}
