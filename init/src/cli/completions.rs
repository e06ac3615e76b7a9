//! `keel completions bash|zsh|fish`: the shell's completion script on stdout.

use clap::CommandFactory;

/// Print a shell completion script (e.g. `keel completions bash > /etc/bash_completion.d/keel`)
#[derive(clap::Args, Debug)]
pub struct CompletionsArgs {
    /// The shell
    #[arg(value_enum)]
    shell: Shell,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Shell {
    Bash,
    Zsh,
    Fish,
}

pub fn main(a: CompletionsArgs) -> i32 {
    let shell = match a.shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    clap_complete::generate(
        shell,
        &mut super::Cli::command(),
        "keel",
        &mut std::io::stdout(),
    );
    0
}
