"""`lora-llama`: its sub-commands' arguments parsed and checked, then handed to `commands.py`.

Nothing here imports torch, so `--help` answers at once.
User mistakes raise `UserError`: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from lora_llama.commands import cmd_eval, cmd_export, cmd_generate, cmd_merge, cmd_push, cmd_studio, cmd_train
from lora_llama.errors import UserError
from lora_llama.model.config import DTYPE_NAMES
from lora_llama.quant.names import FROM_FLOAT, SETTINGS
from lora_llama.runtime.launcher import speaks_for_job

DEFAULT_MODEL = "smollm2-135m-instruct"


def _model_args(sp, adapter=True):
    sp.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"HF folder, .gguf file, Hub id or registered name (default: {DEFAULT_MODEL})",
    )
    if adapter:
        sp.add_argument("--adapter", help="a PEFT LoRA adapter folder to apply")
    sp.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_NAMES))
    sp.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default: auto)")


def _onto_args(sp):
    sp.add_argument(
        "--onto",
        default="original",
        choices=["original", "dequantized"],
        help="fold the adapter into the full-precision weights (default) or into dequant(quant(W)), "
        "the weights an adapter trained on an int8 / nf4 base saw",
    )
    sp.add_argument(
        "--quantize",
        choices=list(SETTINGS),
        help="for --onto dequantized (default: model.quantize of the adapter's run folder)",
    )
    sp.add_argument("--nf4-double-quant", action="store_true", help="with --quantize nf4: its absmax in 8 bits")


def _checked(convert, ok, fault: str):
    """An argparse type: convert(text), refused in one line, before any work, unless ok(value)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{' whole' if convert is int else ''} number") from None
        if not ok(value):  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"{value} {fault}")
        return value

    return parse


POSITIVE = _checked(int, lambda n: n >= 1, "is less than 1")
NOT_NEGATIVE = _checked(int, lambda n: n >= 0, "is below 0")
PORT = _checked(int, lambda n: 0 <= n <= 65535, "is not a port (0 to 65535)")
SHARE = _checked(float, lambda p: 0 < p <= 1, "is not in (0, 1]")
AT_LEAST_ZERO = _checked(float, lambda x: x >= 0, "is below 0")


def _add_train(sub):
    t = sub.add_parser(
        "train",
        help="fit a LoRA adapter from a YAML recipe",
        description="Fit a LoRA adapter. Overrides set any recipe key: train.max_steps=20 lora.r=16",
    )
    t.add_argument("recipe", help="YAML recipe (see recipes/)")
    t.add_argument("overrides", nargs="*", metavar="key.path=value")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the run folder's latest checkpoint (also automatic when the folder holds checkpoints)",
    )
    t.add_argument("--force", action="store_true", help="start over in an output.dir that holds an earlier run")
    t.add_argument(
        "--nproc-per-node",
        type=POSITIVE,
        metavar="N",
        help="train on N processes of this machine through torchrun (N GPUs, or N CPU processes with gloo)",
    )
    t.add_argument("--nnodes", type=POSITIVE, default=1, metavar="N", help="machines in the job (torchrun's --nnodes)")
    t.add_argument(
        "--node-rank",
        type=NOT_NEGATIVE,
        default=0,
        metavar="R",
        help="this machine's place, 0..N-1; node 0 hosts the rendezvous (torchrun's --node-rank)",
    )
    t.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="node 0's address, the same on every node (torchrun's --rdzv-endpoint, c10d rendezvous)",
    )
    t.set_defaults(func=cmd_train)


def _add_merge(sub):
    m = sub.add_parser("merge", help="fold an adapter into the base weights and write an HF checkpoint")
    m.add_argument("--base", required=True, help="the base model the adapter was trained on (any MODEL form)")
    m.add_argument("--adapter", required=True, help="PEFT LoRA adapter folder")
    m.add_argument("--out", required=True, help="output folder (refused if it exists, unless --force)")
    m.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="output dtype (default: the base's)")
    m.add_argument("--force", action="store_true", help="replace an existing --out")
    _onto_args(m)
    m.set_defaults(func=cmd_merge)


def _add_export(sub):
    x = sub.add_parser(
        "export",
        help="write base (+ adapter) as a GGUF file for llama.cpp / Ollama, or an adapter as a llama.cpp LoRA GGUF",
    )
    x.add_argument("--base", help="the base model (any MODEL form); for --lora-gguf, default: the adapter's base")
    x.add_argument("--adapter", help="PEFT LoRA adapter folder, merged in (or, with --lora-gguf, exported alone)")
    x.add_argument("--out", help="output .gguf file (refused if it exists, unless --force); a Modelfile goes beside it")
    x.add_argument("--type", default="f16", choices=["f16", "bf16", "q8_0"], help="weights' type (default: f16)")
    x.add_argument("--lora-gguf", metavar="FILE.gguf", help="write the adapter alone as a llama.cpp LoRA GGUF")
    x.add_argument("--force", action="store_true", help="replace an existing output")
    _onto_args(x)
    x.set_defaults(func=cmd_export)


def _add_push(sub):
    u = sub.add_parser("push", help="upload an adapter (or a run's final adapter) to the Hugging Face Hub")
    u.add_argument("path", metavar="ADAPTER_OR_RUN_DIR")
    u.add_argument("--repo-id", required=True, help="USER/NAME")
    u.add_argument("--private", action="store_true")
    u.add_argument("--revision", help="branch to push to (created when missing)")
    u.add_argument("--commit-message")
    u.add_argument("--token", help="Hub token (default: HF_TOKEN, then the cached login)")
    u.add_argument("--dry-run", action="store_true", help="list the files and print the card; contact nobody")
    u.set_defaults(func=cmd_push)


def _add_generate(sub):
    g = sub.add_parser("generate", help="generate text with the KV cache")
    _model_args(g)
    g.add_argument("--prompt", required=True, action="append", help="the prompt; repeat for several")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument(
        "--compare",
        action="store_true",
        help="print the base model's answer and the adapter's for each prompt, one under the other",
    )
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    g.add_argument("--temperature", type=AT_LEAST_ZERO, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=POSITIVE)
    g.add_argument("--top-p", type=SHARE)
    g.add_argument("--seed", type=int)
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slow; for checks)")
    g.set_defaults(func=cmd_generate)


def _add_eval(sub):
    e = sub.add_parser(
        "eval",
        help="loss and perplexity on documents (--data), or lm-evaluation-harness benchmarks (--tasks)",
    )
    _model_args(e)
    e.add_argument("--data", help="text file (one document per line) or JSON/JSONL with a 'text' field")
    e.add_argument("--tasks", help="lm-eval task names, comma-separated (e.g. arc_easy,hellaswag)")
    e.add_argument("--include-path", metavar="DIR", help="a folder of lm-eval task YAML files (local tasks)")
    e.add_argument("--limit", type=POSITIVE, help="at most this many examples per task")
    e.add_argument("--num-fewshot", type=NOT_NEGATIVE, help="examples shown before each question")
    e.add_argument("--chat", action="store_true", help="prompts through the tokenizer's chat template")
    e.add_argument("--compare", action="store_true", help="with --adapter: the base and the adapter side by side")
    e.add_argument("--quantize", choices=list(FROM_FLOAT), help="hold the base in 8 or 4 bits, as in training")
    e.add_argument("--output", metavar="FILE.json", help="lm-eval's results (default: lm-eval-DATE-TIME.json)")
    e.add_argument("--force", action="store_true", help="overwrite --output")
    e.add_argument("--batch-size", type=POSITIVE, default=8)
    e.set_defaults(func=cmd_eval)


def _add_studio(sub):
    s = sub.add_parser("studio", help="a local web page: runs and their curves, a form that starts new ones")
    s.add_argument("--runs", default="runs", metavar="DIR", help="the runs folder it shows and writes (default: runs)")
    s.add_argument("--host", default="127.0.0.1", help="the address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=PORT, default=7860, help="(default: 7860; 0: any free port)")
    s.add_argument(
        "--token", help="the token every request carries (default: a new random one, printed in the studio's URL)"
    )
    s.add_argument(
        "--auth", metavar="USER:PASS", help="HTTP basic auth besides the token; needed to bind another address"
    )
    s.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAME,...",
        help="host names the studio answers to besides loopback and --host's (a name a proxy or DNS gives it)",
    )
    s.set_defaults(func=cmd_studio)


class _Parser(argparse.ArgumentParser):
    """argparse with its mistakes in one line, as every other mistake (`--help` shows the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lora-llama", description="LoRA fine-tuning for LLaMA-family models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_train, _add_merge, _add_export, _add_push, _add_generate, _add_eval, _add_studio):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides may follow options: `train r.yaml --force lora.r=4`
        if args.command != "train" or any(x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    code = _run(args)
    if os.environ.get("LORA_LLAMA_EXIT_FILE") and speaks_for_job():
        with open(
            os.environ["LORA_LLAMA_EXIT_FILE"], "w"
        ) as f:  # for `train --nproc-per-node`: rank 0's code is the job's
            f.write(str(code))
    return code


def check_combinations(args) -> None:
    """Options that only work together, refused before any work (the docs test checks documented commands too)."""
    if args.command == "export":
        if args.lora_gguf and (not args.adapter or args.out):
            raise UserError("--lora-gguf writes the adapter alone: give --adapter and no --out")
        if not args.lora_gguf and (not args.base or not args.out):
            raise UserError("export needs --base and --out FILE.gguf (or --adapter and --lora-gguf FILE.gguf)")
    if args.command in ("generate", "eval") and args.compare and not args.adapter:
        raise UserError("--compare needs --adapter: it shows the base model's answers beside the adapter's")
    if args.command == "eval" and (args.data is None) == (args.tasks is None):
        raise UserError("eval needs --data FILE (loss and perplexity) or --tasks t1,t2 (lm-eval's benchmarks)")


def _run(args) -> int:
    try:
        check_combinations(args)
        return args.func(args)
    except UserError as e:
        if speaks_for_job():  # one line for the job: every rank meets the same error together
            print(f"lora-llama {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine refused a read or write (disk full, permissions): no traceback for that
        print(
            f"lora-llama {args.command}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""),
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM turned into a clean stop by the trainer
        print(f"lora-llama {args.command}: {'stopped by ' + e.args[0] if e.args else 'interrupted'}", file=sys.stderr)
        return 143 if e.args and e.args[0] == "SIGTERM" else 130


if __name__ == "__main__":
    sys.exit(main())
