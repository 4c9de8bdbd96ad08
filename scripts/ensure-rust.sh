# Sourced by the scripts: makes sure a Rust toolchain (1.88 or newer) is on PATH.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: no Rust toolchain found. Install one (https://rustup.rs: rustup toolchain install stable)" >&2
  echo "       and run this again; Debian's packaged cargo is too old for the dependencies." >&2
  exit 1
fi
