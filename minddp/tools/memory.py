"""Will it fit? What one rank holds in training, per line, with the formula behind each line.

    minddp memory --arch llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 \\
        --ffn 14336 --vocab 128256 --untied --sequence 4096 --micro-batch 1   # Llama 3.1 8B
    minddp memory --layers 2 --hidden 16 --heads 4 --vocab 32 --sequence 8 --micro-batch 4 \\
        --dp 2 --zero 3 --precision fp32 --activations cpu                  # the small GPT

A model (--arch gpt: minddp's small GPT and nanoGPT, learned positions, LayerNorm and
Linear biases, a 4h GELU MLP; llama: RMSNorm, no biases, grouped k and v heads, a SwiGLU MLP
of --ffn), a mesh (--dp, --tp, --pp), a sharding (--zero 0: DDP; 1: the optimizer state
sharded over dp; 2: the gradients too; 3: the parameters too, FSDP), a precision and a
recomputation policy. Per rank (the first pipeline stage, the one holding the embedding
and the most microbatches in flight):

  parameters   N / tp in the blocks' split matrices (column splits with their biases, row
               splits without), the rest whole; / pp by layers; / dp at --zero 3
  gradients    as the parameters, / dp from --zero 2
  optimizer    AdamW: 2 fp32 states per parameter, and a step count (4 bytes) per tensor;
               bf16: also the fp32 master weights (4N); / dp from --zero 1
  activations  per block and microbatch: --activations playbook (the Ultra-Scale
               Playbook's: half precision, eager attention, 1-byte dropout masks) none
               34sbh + 5as^2b, selective 34sbh, full 2sbh; --activations cpu (the benchmark
               block in fp32 on CPU as minddp recompute-bench measures it: flash attention,
               float32 masks) none 72sbh + 16sb + 4asb (64sbh without
               --dropout), selective 44sbh + 4asb, full 4sbh; under tp the split layers'
               part / tp (activation_bytes); x the blocks of a stage x pp microbatches in
               flight (1F1B's first stage); blocks only (embeddings, logits, loss not)
"""

from ..run.cli import ArgumentParser
from ..launch.usage_error import UsageError

PRECISIONS = {"fp32": (4, 4, 0), "bf16": (2, 2, 4), "bf16-fp32-grads": (2, 6, 4)}
# precision: (bytes per parameter, per gradient (an fp32 accumulation buffer beside the
# bf16 one: 2 + 4), per fp32 master weight)


def parse(argv=None):
    p = ArgumentParser(prog="minddp memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="gpt", choices=["gpt", "llama"])
    for name, default, what in [("layers", 2, "transformer blocks"), ("hidden", 16, "h"),
                                ("heads", 4, "a"), ("vocab", 32, "v"), ("sequence", 8, "s"),
                                ("micro-batch", 4, "b, sequences per microbatch and rank"),
                                ("dp", 1, "data-parallel ranks"), ("tp", 1, "tensor-parallel"),
                                ("pp", 1, "pipeline stages")]:
        p.add_argument(f"--{name}", type=int, default=default, help=what)
    p.add_argument("--kv-heads", type=int, help="llama: k and v heads (default: --heads)")
    p.add_argument("--ffn", type=int, help="llama: the MLP's width (gpt: 4h)")
    p.add_argument("--untied", action="store_true", help="the output layer its own weight")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--activations", default="playbook", choices=["playbook", "cpu"],
                   help="playbook: half-precision activations, eager attention, 1-byte masks"
                        " (the Ultra-Scale Playbook's); cpu: fp32, flash attention, float32"
                        " masks (the benchmark block on CPU, as measured)")
    p.add_argument("--dropout", action="store_true",
                   help="--activations cpu: the blocks drop out (their float32 masks kept)")
    return p.parse_args(argv)


def check(args):
    """The mesh against the model, one line each."""
    if args.heads % args.tp or (args.kv_heads or args.heads) % args.tp:
        raise UsageError(f"--tp {args.tp} does not divide the {args.heads} heads",
                         hint="a tp that divides --heads (and --kv-heads)")
    if args.layers % args.pp:
        raise UsageError(f"--pp {args.pp} does not divide the {args.layers} layers",
                         hint="a pp that divides --layers")
    if args.hidden % args.heads:
        raise UsageError(f"--heads {args.heads} does not divide --hidden {args.hidden}",
                         hint="a head width hidden / heads that is a whole number")
    return args


def block_parameters(args):
    """(elements per block on one tp rank, tensors per block)."""
    h, t = args.hidden, args.tp
    if args.arch == "gpt":  # q, k, v, up: column splits (bias too); o, down: row splits
        return (12 * h * h + 7 * h) // t + 6 * h, 16
    kv = h * (args.kv_heads or args.heads) // args.heads  # k and v: grouped heads
    ffn = args.ffn or 4 * h
    return (2 * h * h + 2 * h * kv + 3 * h * ffn) // t + 2 * h, 9


def stage_parameters(args):
    """(elements, tensors) on the first pipeline stage: its blocks, the embedding, and (one
    stage) the head; the whole model with --pp 1."""
    h, v = args.hidden, args.vocab
    per, tensors = block_parameters(args)
    blocks = args.layers // args.pp
    elements, count = blocks * per, blocks * tensors
    elements += v * h + (args.sequence * h if args.arch == "gpt" else 0)  # wte (+ wpe)
    count += 2 if args.arch == "gpt" else 1
    if args.pp == 1:  # the head on this stage too: its norm, and its own weight if untied
        elements += (2 * h if args.arch == "gpt" else h) + (v * h if args.untied else 0)
        count += (2 if args.arch == "gpt" else 1) + (1 if args.untied else 0)
    return elements, count


def activation_bytes(args):
    """What one block keeps for backward per microbatch, on one tp rank (formulas: above).
    Under tp the split layers' tensors are 1/t each; the LayerNorms', the residual stream's
    and the row splits' outputs are whole on every tp rank (no sequence parallelism)."""
    s, b, h, a, t = args.sequence, args.micro_batch, args.hidden, args.heads, args.tp
    sbh = s * b * h
    if args.activations == "cpu":  # split: q, k, v 12, attention 4, MLP 16 + 16; whole: 16
        masks = 8 * sbh if args.dropout else 0  # (two float32 masks, after the row splits)
        per = {"none": 48 * sbh / t + 16 * sbh + masks + 16 * s * b + 4 * a * s * b / t,
               # kept: the input, and each matmul's output (the row splits' whole: 4 + 4)
               "selective": 32 * sbh / t + 12 * sbh + 4 * a * s * b / t,
               "full": 4 * sbh}
    else:  # Korthikanti et al.'s, without sequence parallelism: sbh(10 + 24/t + 5as/(ht))
        per = {"none": sbh * (10 + 24 / t) + 5 * a * s * s * b / t,
               "selective": sbh * (10 + 24 / t), "full": 2 * sbh}
    return per[args.recompute]


def plan(args):
    """[(line, bytes per rank, the formula behind it)]."""
    check(args)
    elements, tensors = stage_parameters(args)
    param, grad, master = PRECISIONS[args.precision]
    d = args.dp
    shard = {what: d if args.zero >= stage else 1
             for what, stage in (("optimizer", 1), ("gradients", 2), ("parameters", 3))}
    where = f"N = {elements:,} elements on this rank's stage and tp slice"
    rows = [("parameters", param * elements / shard["parameters"],
             f"{param} N" + (f" / dp {d}" if shard["parameters"] > 1 else "") + f"; {where}"),
            ("gradients", grad * elements / shard["gradients"],
             f"{grad} N" + (f" / dp {d}" if shard["gradients"] > 1 else "")),
            # AdamW keeps a step count per tensor: on every rank for each of its tensors
            # (FSDP's shards included); ZeRO-1 hands each rank whole tensors
            ("optimizer", (8 + master) * elements / shard["optimizer"] +
             4 * tensors / (d if args.zero == 1 else 1),
             f"{8 + master} N" + (f" / dp {d}" if shard["optimizer"] > 1 else "") +
             f" + 4 x {tensors} tensors' step counts" + (f" / dp {d}" if args.zero == 1 else ""))]
    blocks, in_flight = args.layers // args.pp, args.pp
    rows.append(("activations", activation_bytes(args) * blocks * in_flight,
                 f"{args.recompute}, {args.activations}: per block {activation_bytes(args):,.0f}"
                 f" B x {blocks} blocks x {in_flight} microbatches in flight"))
    rows.append(("peak", sum(r[1] for r in rows), "the sum (no allocator overhead, no"
                 " buffers for communication, no logits)"))
    return rows


def human(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def main(argv=None):
    from tabulate import tabulate
    from ..run.errors import exit_on_usage_error
    args = parse(argv)
    with exit_on_usage_error():
        rows = plan(args)
    print(f"{args.arch}: {args.layers} layers, h={args.hidden}, a={args.heads}, v={args.vocab},"
          f" s={args.sequence}, b={args.micro_batch} | dp={args.dp} tp={args.tp} pp={args.pp},"
          f" zero {args.zero}, {args.precision}, recompute {args.recompute} | per rank:")
    print(tabulate([(what, human(n), f"{n:,.0f}", why) for what, n, why in rows],
                   headers=["", "per rank", "bytes", "formula"], disable_numparse=True))
    return rows


if __name__ == "__main__":
    main()
