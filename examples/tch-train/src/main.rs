//! Trains a small GPT-style transformer with tch on CUDA, the sequence length changing every
//! step (so the memory of every step has another shape), under gmlake (`--allocator gmlake`)
//! or PyTorch's native caching allocator (`--allocator native`), and prints the losses, memory
//! utilization (peak active / peak reserved) and statistics. With the same seed both
//! allocators must print the same losses and checksums: the allocator changes where tensors
//! live, not what they hold.
//!
//! Besides training, a data check fills tensors with known integers, frees every other one
//! (leaving holes), allocates larger tensors (which gmlake serves by stitching the holes'
//! pages), and compares every live tensor with its expected content on the CPU.
//!
//! Run: `tch-train --allocator gmlake --library path/to/libgmlake_torch.so` (or set
//! GMLAKE_LIBRARY), then `tch-train --allocator native`. `--install-late` checks that an
//! install after the first CUDA tensor fails with a clear error. `--help` lists the options.

use std::ffi::{c_char, c_int, c_longlong, CStr};
use std::fmt::Write as _;
use std::time::Instant;

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ---------------------------------------------------------------------------------------------
// torch's view of the current CUDA allocator (src/torch_memory.cpp)

/// Mirrors `TorchMemory` in src/torch_memory.cpp.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct TorchMemory {
    allocated_current: i64,
    allocated_peak: i64,
    reserved_current: i64,
    reserved_peak: i64,
    active_current: i64,
    active_peak: i64,
    requested_peak: i64,
    allocations: i64,
    segments_current: i64,
    num_device_alloc: i64,
    num_device_free: i64,
    num_alloc_retries: i64,
    num_ooms: i64,
}

extern "C" {
    fn tch_train_memory_stats(device: c_int, out: *mut TorchMemory) -> c_int;
    fn tch_train_empty_cache() -> c_int;
    fn tch_train_allocator_type(buf: *mut c_char, len: usize) -> c_longlong;
    fn tch_train_last_error() -> *const c_char;
}

fn shim_error() -> String {
    // SAFETY: a NUL-terminated thread-local string, copied at once.
    unsafe { CStr::from_ptr(tch_train_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn torch_memory(device: i32) -> Result<TorchMemory, String> {
    let mut m = TorchMemory::default();
    // SAFETY: `m` is a valid TorchMemory; the C function catches every exception.
    if unsafe { tch_train_memory_stats(device, &mut m) } != 0 {
        return Err(shim_error());
    }
    Ok(m)
}

fn torch_empty_cache() -> Result<(), String> {
    // SAFETY: no arguments; the C function catches every exception.
    if unsafe { tch_train_empty_cache() } != 0 {
        return Err(shim_error());
    }
    Ok(())
}

fn allocator_type() -> String {
    let mut buf = vec![0u8; 512];
    // SAFETY: `buf` has buf.len() bytes.
    let n = unsafe { tch_train_allocator_type(buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return format!("unknown ({})", shim_error());
    }
    buf.truncate((n as usize).min(511));
    String::from_utf8_lossy(&buf).into_owned()
}

// ---------------------------------------------------------------------------------------------
// Options

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Allocator {
    Gmlake,
    Native,
}

#[derive(Debug, Clone)]
struct Options {
    allocator: Allocator,
    library: Option<String>,
    conf: String,
    device: i32,
    steps: usize,
    seed: u64,
    layers: i64,
    d_model: i64,
    heads: i64,
    vocab: i64,
    min_seq: i64,
    max_seq: i64,
    tokens: i64,
    lr: f64,
    json: Option<String>,
    install_late: bool,
    cpu: bool,
    quiet: bool,
}

const USAGE: &str = "\
tch-train: a small transformer trained with tch under gmlake or the native allocator

options:
  --allocator gmlake|native   the CUDA allocator (default gmlake)
  --library PATH              libgmlake_torch.so (default: $GMLAKE_LIBRARY, then the loader's
                              search path and the executable's folder)
  --conf K:V,...              gmlake configuration (default: none, GMLAKE_CONF still applies)
  --device N                  CUDA device (default 0)
  --steps N                   training steps (default 100)
  --seed N                    seed of weights and data (default 1234)
  --layers N --d-model N --heads N --vocab N   model size (default 6, 512, 8, 256)
  --min-seq N --max-seq N     sequence length range, drawn per step (default 32, 1024)
  --tokens N                  tokens per step: batch = tokens / length (default 16384)
  --lr X                      Adam learning rate (default 0.0003)
  --json PATH                 write a summary as JSON
  --install-late              create a CUDA tensor first, then install gmlake: expect a
                              'too late' error (exit 0 when it comes, 1 otherwise)
  --cpu                       train on the CPU (a smoke test where there is no GPU; gmlake
                              is still installed with --allocator gmlake, and unused)
  --quiet                     print every 10th step only
";

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        allocator: Allocator::Gmlake,
        library: None,
        conf: String::new(),
        device: 0,
        steps: 100,
        seed: 1234,
        layers: 6,
        d_model: 512,
        heads: 8,
        vocab: 256,
        min_seq: 32,
        max_seq: 1024,
        tokens: 16384,
        lr: 3e-4,
        json: None,
        install_late: false,
        cpu: false,
        quiet: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        fn num<T: std::str::FromStr>(name: &str, v: String) -> Result<T, String> {
            v.parse().map_err(|_| format!("{name}: not a number: {v}"))
        }
        match a.as_str() {
            "--allocator" => {
                o.allocator = match value("--allocator")?.as_str() {
                    "gmlake" => Allocator::Gmlake,
                    "native" => Allocator::Native,
                    v => return Err(format!("--allocator: gmlake or native, not {v}")),
                }
            }
            "--library" => o.library = Some(value("--library")?),
            "--conf" => o.conf = value("--conf")?,
            "--device" => o.device = num("--device", value("--device")?)?,
            "--steps" => o.steps = num("--steps", value("--steps")?)?,
            "--seed" => o.seed = num("--seed", value("--seed")?)?,
            "--layers" => o.layers = num("--layers", value("--layers")?)?,
            "--d-model" => o.d_model = num("--d-model", value("--d-model")?)?,
            "--heads" => o.heads = num("--heads", value("--heads")?)?,
            "--vocab" => o.vocab = num("--vocab", value("--vocab")?)?,
            "--min-seq" => o.min_seq = num("--min-seq", value("--min-seq")?)?,
            "--max-seq" => o.max_seq = num("--max-seq", value("--max-seq")?)?,
            "--tokens" => o.tokens = num("--tokens", value("--tokens")?)?,
            "--lr" => o.lr = num("--lr", value("--lr")?)?,
            "--json" => o.json = Some(value("--json")?),
            "--install-late" => o.install_late = true,
            "--cpu" => o.cpu = true,
            "--quiet" => o.quiet = true,
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a}\n{USAGE}")),
        }
    }
    if o.min_seq < 2 || o.max_seq < o.min_seq {
        return Err("need 2 <= --min-seq <= --max-seq".into());
    }
    if o.cpu && o.install_late {
        return Err("--install-late needs a GPU (not --cpu)".into());
    }
    if o.heads <= 0 || o.d_model % o.heads != 0 {
        return Err("--d-model must be a multiple of --heads".into());
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// The model: GPT-style, pre-norm blocks, explicit causal attention (its scores are
// batch x heads x len x len: the memory of each step depends on the length squared).

struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    heads: i64,
}

impl Block {
    fn new(p: nn::Path, d: i64, heads: i64) -> Block {
        let c = nn::LinearConfig::default();
        Block {
            ln1: nn::layer_norm(&p / "ln1", vec![d], Default::default()),
            qkv: nn::linear(&p / "qkv", d, 3 * d, c),
            proj: nn::linear(&p / "proj", d, d, c),
            ln2: nn::layer_norm(&p / "ln2", vec![d], Default::default()),
            fc1: nn::linear(&p / "fc1", d, 4 * d, c),
            fc2: nn::linear(&p / "fc2", 4 * d, d, c),
            heads,
        }
    }

    fn forward(&self, x: &Tensor, causal: &Tensor) -> Tensor {
        let (b, t, d) = x.size3().expect("x is batch x len x d");
        let hd = d / self.heads;
        let qkv = x
            .apply(&self.ln1)
            .apply(&self.qkv)
            .view([b, t, 3, self.heads, hd])
            .permute([2, 0, 3, 1, 4]); // 3 x b x heads x t x hd
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let scores = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hd as f64).sqrt());
        let att = scores
            .masked_fill(causal, f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let y = att
            .matmul(&v)
            .transpose(1, 2)
            .contiguous()
            .view([b, t, d])
            .apply(&self.proj);
        let x = x + y;
        let h = x
            .apply(&self.ln2)
            .apply(&self.fc1)
            .gelu("none")
            .apply(&self.fc2);
        x + h
    }
}

struct Gpt {
    /// Token embedding, applied as one-hot x matrix: a GEMM in both directions, so training
    /// is deterministic on the GPU (an embedding lookup's backward may not be).
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
    vocab: i64,
}

impl Gpt {
    fn new(p: &nn::Path, o: &Options) -> Gpt {
        let init = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        Gpt {
            wte: p.var("wte", &[o.vocab, o.d_model], init),
            wpe: p.var("wpe", &[o.max_seq, o.d_model], init),
            blocks: (0..o.layers)
                .map(|i| Block::new(p / format!("block{i}"), o.d_model, o.heads))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![o.d_model], Default::default()),
            head: nn::linear(p / "head", o.d_model, o.vocab, Default::default()),
            vocab: o.vocab,
        }
    }

    /// Logits, batch x len x vocab.
    fn forward(&self, tokens: &Tensor) -> Tensor {
        let (_, t) = tokens.size2().expect("tokens are batch x len");
        let onehot = tokens.one_hot(self.vocab).to_kind(Kind::Float);
        let mut x = onehot.matmul(&self.wte) + self.wpe.narrow(0, 0, t);
        // true above the diagonal: the future, masked out.
        let causal = Tensor::ones([t, t], (Kind::Float, tokens.device()))
            .triu(1)
            .to_kind(Kind::Bool);
        for b in &self.blocks {
            x = b.forward(&x, &causal);
        }
        x.apply(&self.ln_f).apply(&self.head)
    }
}

// ---------------------------------------------------------------------------------------------
// Data: a copy task (the second half of each sequence repeats the first), from a seeded
// generator of our own so it does not depend on torch's random state.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `batch` sequences of `len` + 1 tokens (inputs and next-token targets).
fn batch(rng: &mut Rng, batch: i64, len: i64, vocab: i64) -> Vec<i64> {
    let n = len + 1;
    let half = (n + 1) / 2;
    let mut v = Vec::with_capacity((batch * n) as usize);
    for _ in 0..batch {
        let first: Vec<i64> = (0..half).map(|_| rng.below(vocab as u64) as i64).collect();
        v.extend((0..n).map(|i| first[(i % half) as usize]));
    }
    v
}

// ---------------------------------------------------------------------------------------------
// The data check

struct DataCheck {
    ok: bool,
    tensors: usize,
    bytes: i64,
    checksum: i64,
    detail: String,
}

/// Fills tensors with known integers, frees every other one, allocates larger ones into the
/// holes' pages, computes on them, and compares every live tensor with the CPU's expectation.
fn data_check(dev: Device, tag: i64) -> DataCheck {
    const MIB: i64 = 1 << 20;
    let expected =
        |n: i64, mul: i64, add: i64, dev: Device| Tensor::arange(n, (Kind::Int64, dev)) * mul + add;
    let mut live: Vec<(Tensor, i64, i64, i64)> = Vec::new(); // tensor, n, mul, add
    let mut holes = Vec::new();
    for i in 0..40i64 {
        let n = (3 + i % 6) * MIB / 8; // 3 to 8 MiB of int64
        let (mul, add) = (i + 1 + tag, 1000 * i);
        let t = expected(n, mul, add, dev);
        if i % 2 == 0 {
            live.push((t, n, mul, add));
        } else {
            holes.push(t);
        }
    }
    drop(holes); // 20 holes of 4 to 8 MiB between live tensors
    for j in 0..6i64 {
        let n = 40 * MIB / 8; // larger than any hole
        let (mul, add) = (j + 7 + tag, 5 - j);
        let t = expected(n, mul, add, dev);
        // A computation into another new tensor: (t * 3 - 1) = arange * 3mul + (3add - 1).
        let u = &t * 3 - 1;
        live.push((t, n, mul, add));
        live.push((u, n, 3 * mul, 3 * add - 1));
    }
    let mut ok = true;
    let mut detail = String::new();
    let mut checksum = 0i64;
    let mut bytes = 0i64;
    for (k, (t, n, mul, add)) in live.iter().enumerate() {
        let cpu = t.to_device(Device::Cpu);
        let want = expected(*n, *mul, *add, Device::Cpu);
        if !cpu.equal(&want) {
            ok = false;
            let wrong = cpu.ne_tensor(&want).sum(Kind::Int64).int64_value(&[]);
            let _ = write!(detail, "tensor {k}: {wrong} of {n} elements differ; ");
        }
        checksum = checksum.wrapping_add(t.sum(Kind::Int64).int64_value(&[]));
        bytes += n * 8;
    }
    DataCheck {
        ok,
        tensors: live.len(),
        bytes,
        checksum,
        detail,
    }
}

// ---------------------------------------------------------------------------------------------

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn gib(b: i64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn ratio(a: i64, b: i64) -> f64 {
    if b > 0 {
        a as f64 / b as f64
    } else {
        0.0
    }
}

fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("tch-train: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&o) {
        eprintln!("tch-train: error: {e}");
        std::process::exit(1);
    }
}

fn install(o: &Options) -> Result<gmlake_tch::Installed, gmlake_tch::Error> {
    match &o.library {
        Some(p) => gmlake_tch::install_from(p, &o.conf),
        None => gmlake_tch::install(&o.conf),
    }
}

fn run(o: &Options) -> Result<(), Box<dyn std::error::Error>> {
    // gmlake first: before anything creates a CUDA tensor.
    let gm = match (o.allocator, o.install_late) {
        (Allocator::Gmlake, false) => {
            let gm = install(o)?;
            println!(
                "gmlake: {:?} from {} (build {})",
                gm.mode(),
                gm.library(),
                gm.build_info()
                    .map(|b| b.json)
                    .unwrap_or_else(|e| e.to_string())
            );
            if let Ok(s) = gm.settings() {
                println!("gmlake settings: {s}");
            }
            Some(gm)
        }
        _ => None,
    };
    let dev = if o.cpu {
        Device::Cpu
    } else if tch::Cuda::is_available() {
        Device::Cuda(o.device as usize)
    } else {
        return Err("no CUDA device (is libtorch_cuda.so loaded? is there a GPU?)".into());
    };
    let sync = || {
        if !o.cpu {
            tch::Cuda::synchronize(o.device as i64);
        }
    };

    if o.install_late {
        let _first = Tensor::ones([1024], (Kind::Float, dev));
        return match install(o) {
            Err(e @ gmlake_tch::Error::TooLate(_)) => {
                println!("install after the first CUDA tensor: refused as expected: {e}");
                Ok(())
            }
            Err(e) => Err(format!("expected Error::TooLate, got another error: {e}").into()),
            Ok(g) => Err(format!("expected Error::TooLate, but the install returned {g:?}").into()),
        };
    }

    let name = match o.allocator {
        Allocator::Gmlake => "gmlake",
        Allocator::Native => "native",
    };
    println!(
        "allocator {name}: torch's CUDA allocator is {}",
        allocator_type()
    );
    if let Some(gm) = &gm {
        println!("gmlake active backend: {:?}", gm.active_backend());
    }
    println!("device: {dev:?}");

    // 1. Data check on a fresh allocator.
    let t0 = Instant::now();
    let check_start = data_check(dev, 0);
    println!(
        "data check (start): {} ({} tensors, {:.2} GiB, checksum {}) {}",
        if check_start.ok { "ok" } else { "FAILED" },
        check_start.tensors,
        gib(check_start.bytes),
        check_start.checksum,
        check_start.detail
    );
    let stitches_after_check = gm
        .as_ref()
        .and_then(|g| g.stats(o.device).ok())
        .map(|s| s.gmlake.stitches);
    if let Some(s) = stitches_after_check {
        println!("gmlake stitches after the data check: {s}");
    }

    // 2. Training, the sequence length drawn per step.
    tch::manual_seed(o.seed as i64);
    let vs = nn::VarStore::new(dev);
    let model = Gpt::new(&vs.root(), o);
    let mut opt = nn::Adam::default().build(&vs, o.lr)?;
    let params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    println!(
        "model: {} layers, d_model {}, {} heads, vocab {}, {:.1} M parameters",
        o.layers,
        o.d_model,
        o.heads,
        o.vocab,
        params as f64 / 1e6
    );
    let mut rng = Rng(o.seed ^ 0x5EED);
    let mut losses = Vec::with_capacity(o.steps);
    let train_start = Instant::now();
    for step in 0..o.steps {
        let len = o.min_seq + rng.below((o.max_seq - o.min_seq + 1) as u64) as i64;
        let b = (o.tokens / len).max(1);
        let data = Tensor::from_slice(&batch(&mut rng, b, len, o.vocab))
            .view([b, len + 1])
            .to_device(dev);
        let input = data.narrow(1, 0, len);
        let target = data.narrow(1, 1, len);
        let logits = model.forward(&input);
        let loss = logits
            .view([-1, o.vocab])
            .cross_entropy_for_logits(&target.reshape([-1]));
        opt.backward_step(&loss);
        let l = loss.double_value(&[]);
        losses.push(l);
        if !o.quiet || step % 10 == 0 || step + 1 == o.steps {
            println!("step {step:4} len {len:5} batch {b:4} loss {l:.8}");
        }
    }
    sync();
    let train_secs = train_start.elapsed().as_secs_f64();

    // 3. A checksum of computed data: the logits of a fixed batch, bit for bit.
    let (logits_hash, logits_sum) = tch::no_grad(|| {
        let mut r = Rng(o.seed ^ 0xE7A1);
        let len = o.max_seq.min(256);
        let data = Tensor::from_slice(&batch(&mut r, 4, len, o.vocab))
            .view([4, len + 1])
            .to_device(dev);
        let logits = model
            .forward(&data.narrow(1, 0, len))
            .to_device(Device::Cpu);
        let v: Vec<f32> = Vec::try_from(logits.flatten(0, -1)).expect("f32 logits");
        let sum: f64 = v.iter().map(|x| f64::from(*x)).sum();
        (fnv1a(v.iter().flat_map(|x| x.to_bits().to_le_bytes())), sum)
    });
    println!("logits checksum: hash {logits_hash:016x} sum {logits_sum:.6}");

    // 4. Data check again, in the cache training left behind.
    let check_end = data_check(dev, 1);
    println!(
        "data check (end): {} ({} tensors, checksum {}) {}",
        if check_end.ok { "ok" } else { "FAILED" },
        check_end.tensors,
        check_end.checksum,
        check_end.detail
    );
    sync();
    if o.cpu {
        // No CUDA memory to report.
        if let Some(path) = &o.json {
            let losses: Vec<String> = losses.iter().map(|l| format!("{l:.8}")).collect();
            std::fs::write(
                path,
                format!(
                    "{{\"allocator\":\"{name}\",\"device\":\"cpu\",\"losses\":[{}],\
                     \"logits_hash\":\"{logits_hash:016x}\",\"data_check_ok\":{},\
                     \"data_checksum\":[{},{}]}}\n",
                    losses.join(","),
                    check_start.ok && check_end.ok,
                    check_start.checksum,
                    check_end.checksum
                ),
            )?;
        }
        if !(check_start.ok && check_end.ok) {
            return Err("data check failed: tensors do not hold what was written".into());
        }
        return Ok(());
    }

    // 5. Memory.
    let tm = torch_memory(o.device)?;
    let util = ratio(tm.active_peak, tm.reserved_peak);
    println!(
        "memory ({name}, torch's counters): peak active {:.3} GiB, peak reserved {:.3} GiB, \
         utilization {util:.3}; allocations {}, device allocs {}, retries {}, ooms {}",
        gib(tm.active_peak),
        gib(tm.reserved_peak),
        tm.allocations,
        tm.num_device_alloc,
        tm.num_alloc_retries,
        tm.num_ooms
    );
    let mut gm_stats = None;
    let mut agree = None;
    if let Some(gm) = &gm {
        let s = gm.stats(o.device)?;
        println!("gmlake stats:\n{s}");
        // torch's registry and gmlake must describe the same allocator.
        let same = s.reserved_bytes.all.peak == tm.reserved_peak
            && s.active_bytes.all.peak == tm.active_peak
            && s.allocation.all.allocated == tm.allocations;
        println!(
            "torch's counters {} gmlake's",
            if same { "equal" } else { "DIFFER from" }
        );
        agree = Some(same);
        gm_stats = Some(s);
    }

    // 6. Empty the cache.
    let emptied_by = match &gm {
        Some(gm) => match gm.empty_cache() {
            Ok(()) => "gmlake_tch::Installed::empty_cache".to_string(),
            Err(e @ gmlake_tch::Error::Unsupported { .. }) => {
                println!("note: {e}; emptying through torch's allocator registry instead");
                torch_empty_cache()?;
                "torch registry (gmlake_empty_cache missing)".to_string()
            }
            Err(e) => return Err(e.into()),
        },
        None => {
            torch_empty_cache()?;
            "torch registry".to_string()
        }
    };
    let after = torch_memory(o.device)?;
    println!(
        "after empty_cache ({emptied_by}): reserved {:.3} GiB, active {:.3} GiB",
        gib(after.reserved_current),
        gib(after.active_current)
    );
    println!(
        "time: {:.2} s training ({:.1} ms/step), {:.2} s total",
        train_secs,
        1e3 * train_secs / o.steps.max(1) as f64,
        t0.elapsed().as_secs_f64()
    );

    // 7. Summary.
    if let Some(path) = &o.json {
        let mut j = String::from("{");
        let _ = write!(
            j,
            "\"allocator\":\"{name}\",\"torch_allocator_type\":\"{}\",\"seed\":{},\"steps\":{},",
            allocator_type(),
            o.seed,
            o.steps
        );
        let _ = write!(
            j,
            "\"losses\":[{}],",
            losses
                .iter()
                .map(|l| format!("{l:.8}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let _ = write!(
            j,
            "\"logits_hash\":\"{logits_hash:016x}\",\"logits_sum\":{logits_sum:.6},\
             \"data_check_ok\":{},\"data_checksum\":[{},{}],",
            check_start.ok && check_end.ok,
            check_start.checksum,
            check_end.checksum
        );
        let _ = write!(
            j,
            "\"torch\":{{\"active_peak\":{},\"reserved_peak\":{},\"allocated_peak\":{},\
             \"requested_peak\":{},\"allocations\":{},\"num_device_alloc\":{},\
             \"num_device_free\":{},\"num_alloc_retries\":{},\"num_ooms\":{},\
             \"utilization\":{util:.6},\"reserved_after_empty_cache\":{}}},",
            tm.active_peak,
            tm.reserved_peak,
            tm.allocated_peak,
            tm.requested_peak,
            tm.allocations,
            tm.num_device_alloc,
            tm.num_device_free,
            tm.num_alloc_retries,
            tm.num_ooms,
            after.reserved_current
        );
        match (&gm_stats, &gm) {
            (Some(s), Some(g)) => {
                let _ = write!(
                    j,
                    "\"gmlake\":{{\"mode\":\"{:?}\",\"allocations\":{},\"reserved_peak\":{},\
                     \"active_peak\":{},\"stitches\":{},\"stitches_after_first_check\":{},\
                     \"pages_stitched\":{},\"num_ooms\":{},\"driver_calls\":{},\
                     \"counters_agree_with_torch\":{},\"utilization\":{:.6}}},",
                    g.mode(),
                    s.allocation.all.allocated,
                    s.reserved_bytes.all.peak,
                    s.active_bytes.all.peak,
                    s.gmlake.stitches,
                    stitches_after_check.unwrap_or(0),
                    s.gmlake.pages_stitched,
                    s.num_ooms,
                    s.gmlake.driver_calls,
                    agree.unwrap_or(false),
                    s.utilization().unwrap_or(0.0)
                );
            }
            _ => j.push_str("\"gmlake\":null,"),
        }
        let _ = write!(
            j,
            "\"train_seconds\":{train_secs:.3},\"emptied_by\":\"{emptied_by}\"}}"
        );
        std::fs::write(path, j + "\n")?;
    }

    if !(check_start.ok && check_end.ok) {
        return Err("data check failed: tensors do not hold what was written".into());
    }
    Ok(())
}
