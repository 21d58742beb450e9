"""A character-level LSTM language model split over three RPC workers, trained with distopt.

The model is cut in three, as in a model too large for one machine:

- ``ps0`` (a parameter server) holds the embedding table,
- ``trainer`` holds the LSTM and runs the training loop,
- ``ps1`` (a parameter server) holds the decoder, a linear layer to the vocabulary.

Every step runs forward and backward inside a ``torch.distributed.autograd`` context, so
each worker's gradients stay with its parameters, then ``distopt.DistributedOptimizer.step``
asks the three owners to update their own parameters in parallel. The text is
``examples/data/lighthouse.txt`` (shipped with the repository), read one character at a time.

Training uses the rest of distopt's control surface: gradients are clipped by their global
norm across the three owners (``opt.clip_grad_norm_``), the learning rate follows a
torch.optim.lr_scheduler (cosine by default) driving the DistributedOptimizer directly, and
``--checkpoint DIR`` saves a checkpoint every ``--save-every`` steps: the optimizer state as
one shard per owner (``opt.save``), plus the model's weights and the scheduler's state.
``--resume`` continues from the last checkpoint in DIR exactly where it stopped, and
``--auto-resume`` does so when DIR holds one (else starts at step 1): the same command
line then serves a first start and every restart, as under ``torchrun --max-restarts``.
Each checkpoint is a folder ``DIR/step-N``; the file ``DIR/latest`` names the last complete
one and is replaced only once a newer one is entirely on disk.

One machine (spawns the three processes on 127.0.0.1, a free port)::

    python examples/model_parallel_rnn.py
    python examples/model_parallel_rnn.py --steps 200 --optimizer AdamW --lr 2e-3
    python examples/model_parallel_rnn.py --checkpoint ckpt --stop-after 150  # "interrupted"
    python examples/model_parallel_rnn.py --checkpoint ckpt --resume          # steps 151...

Several machines: start one process per role with ``torchrun`` (rank 0 is the trainer,
rank 1 ``ps0``, rank 2 ``ps1``; only the trainer reads the text)::

    # on each of three machines, R = 0, 1, 2; HOST0 is the machine with rank 0
    torchrun --nnodes 3 --nproc-per-node 1 --node-rank R \\
        --master-addr HOST0 --master-port 29500 examples/model_parallel_rnn.py

or set ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` (0, 1, 2) and ``WORLD_SIZE=3`` yourself
and run ``python examples/model_parallel_rnn.py`` on each machine. The options must be the
same everywhere.
"""
import argparse
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

try:
    import distopt
except ImportError:  # running from a clone that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import distopt

import _checkpoints
import _launch

WORKERS = ["trainer", "ps0", "ps1"]
DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lighthouse.txt")

State = Tuple[Tensor, Tensor]


# ---------------------------------------------------------------- the parts on the servers


class EmbeddingTable(nn.Module):
    """The embedding table; lives on ``ps0``."""

    def __init__(self, vocab_size: int, dim: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(vocab_size, dim)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens)


class Decoder(nn.Module):
    """The output layer, LSTM features to vocabulary logits; lives on ``ps1``."""

    def __init__(self, hidden: int, vocab_size: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(hidden, vocab_size)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(features)


def call_module(module_rref: rpc.RRef, x: Tensor) -> Tensor:
    """RPC target: run the module behind ``module_rref`` (owned by the callee) on ``x``."""
    return module_rref.local_value()(x)


def parameter_rrefs(module_rref: rpc.RRef) -> List[rpc.RRef]:
    """RPC target: RRefs to the parameters of the module behind ``module_rref``."""
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def module_state(module_rref: rpc.RRef) -> Dict[str, Tensor]:
    """RPC target: a copy of the module's weights."""
    return {k: v.detach().clone() for k, v in module_rref.local_value().state_dict().items()}


def load_module_state(module_rref: rpc.RRef, state: Dict[str, Tensor]) -> None:
    """RPC target: overwrite the module's weights in place (its parameters keep their identity,
    so the optimizer's RRefs to them stay valid)."""
    module_rref.local_value().load_state_dict(state)


# ---------------------------------------------------------------- the model, on the trainer


class SplitLanguageModel(nn.Module):
    """Embedding on ``ps0``, LSTM here, decoder on ``ps1``.

    Args:
        vocab_size: number of distinct characters.
        embedding_dim: size of a character's embedding.
        hidden: LSTM state size.
        layers: number of stacked LSTM layers.
        seed: initialisation seed (each part adds its own offset).
    """

    def __init__(
        self, vocab_size: int, embedding_dim: int, hidden: int, layers: int, seed: int
    ) -> None:
        super().__init__()
        self.embedding_rref = rpc.remote(
            "ps0", EmbeddingTable, args=(vocab_size, embedding_dim, seed + 1)
        )
        torch.manual_seed(seed)
        self.lstm = nn.LSTM(embedding_dim, hidden, layers, batch_first=True)
        self.decoder_rref = rpc.remote("ps1", Decoder, args=(hidden, vocab_size, seed + 2))

    def forward(self, tokens: Tensor, state: Optional[State]) -> Tuple[Tensor, State]:
        embedded = rpc.rpc_sync("ps0", call_module, args=(self.embedding_rref, tokens))
        features, state = self.lstm(embedded, state)
        logits = rpc.rpc_sync("ps1", call_module, args=(self.decoder_rref, features))
        return logits, state

    def parameter_rrefs(self) -> List[rpc.RRef]:
        """RRefs to every parameter of the model, wherever it lives."""
        remote = rpc.rpc_sync("ps0", parameter_rrefs, args=(self.embedding_rref,))
        remote += rpc.rpc_sync("ps1", parameter_rrefs, args=(self.decoder_rref,))
        return remote + [rpc.RRef(p) for p in self.lstm.parameters()]

    def weights(self) -> Dict[str, Dict[str, Tensor]]:
        """Every part's weights, gathered on the trainer (for a checkpoint)."""
        return {
            "embedding": rpc.rpc_sync("ps0", module_state, args=(self.embedding_rref,)),
            "lstm": {k: v.detach().clone() for k, v in self.lstm.state_dict().items()},
            "decoder": rpc.rpc_sync("ps1", module_state, args=(self.decoder_rref,)),
        }

    def load_weights(self, weights: Dict[str, Dict[str, Tensor]]) -> None:
        """Put back weights from ``weights()``, in place on every worker."""
        rpc.rpc_sync("ps0", load_module_state, args=(self.embedding_rref, weights["embedding"]))
        self.lstm.load_state_dict(weights["lstm"])
        rpc.rpc_sync("ps1", load_module_state, args=(self.decoder_rref, weights["decoder"]))


# ---------------------------------------------------------------- data


class CharCorpus:
    """A text as character ids: its end held out, the rest cut into parallel streams.

    Args:
        path: a UTF-8 text file.
        batch_size: number of training streams read side by side.
        held_out: the fraction of the text, at its end, kept for evaluation.

    Raises:
        ValueError: the text is too short for the batch size.
    """

    def __init__(self, path: str, batch_size: int, held_out: float = 0.1) -> None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        n_train = int(len(ids) * (1.0 - held_out))
        ids, self.held_out = ids[:n_train], ids[n_train:]
        per_stream = len(ids) // batch_size
        if per_stream < 2:
            raise ValueError(
                f"Invalid batch_size: {batch_size!r} (expected at most {len(ids) // 2} for a "
                f"text of {len(ids)} characters)"
            )
        self.streams = ids[: per_stream * batch_size].view(batch_size, per_stream)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def windows(self, length: int):
        """Endless (inputs, targets, restarted) windows, walking the streams in order."""
        span = self.streams.size(1)
        start = 0
        while True:
            restarted = start == 0
            stop = min(start + length, span - 1)
            yield self.streams[:, start:stop], self.streams[:, start + 1 : stop + 1], restarted
            start = 0 if stop >= span - 1 else stop

    def decode(self, ids: List[int]) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------- checkpoints

TRAINER_FILE = "trainer.pt"
#: The options a resumed run must share with the run that saved the checkpoint.
RESUME_KEYS = ("optimizer", "lr", "hidden", "layers", "embedding_dim", "batch_size", "seq_len",
               "seed", "text", "clip", "schedule", "steps")


def save_checkpoint(
    directory: str, model: SplitLanguageModel, opt: "distopt.DistributedOptimizer",
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler], step: int,
    lstm_state: Optional[State] = None, recorded: Optional[Dict[str, object]] = None,
) -> str:
    """Save everything needed to go on after ``step`` into ``directory/step-<step>``.

    The optimizer state goes as one shard per owner (``opt.save``), then the weights and the
    trainer's position (``trainer.pt``); only then does ``latest`` name the new folder
    (``_checkpoints.publish``), so a crash at any point leaves it naming the previous
    complete checkpoint. Returns the new folder.
    """
    folder = _checkpoints.folder_for(directory, step)
    opt.save(folder)
    trainer = {
        "step": step,
        "weights": model.weights(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "lstm_state": lstm_state,
        "options": recorded or {},
    }
    _checkpoints.save_tensors(os.path.join(folder, TRAINER_FILE), trainer)
    _checkpoints.publish(folder)
    return folder


def load_checkpoint(
    folder: str, model: SplitLanguageModel, opt: "distopt.DistributedOptimizer",
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler],
) -> Tuple[int, Optional[State]]:
    """Restore the checkpoint ``folder`` (a ``step-N`` folder); returns the step it was taken
    after and the LSTM state carried into the next step. ``opt.load`` checks every shard
    (size, CRC-32, parameters) before any owner changes; the weights are put back only after
    that."""
    trainer = torch.load(os.path.join(folder, TRAINER_FILE), weights_only=True)
    opt.load(folder)
    model.load_weights(trainer["weights"])
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    lstm_state = trainer["lstm_state"]
    return int(trainer["step"]), None if lstm_state is None else tuple(lstm_state)


# ---------------------------------------------------------------- training


def held_out_loss(model: SplitLanguageModel, corpus: CharCorpus) -> float:
    """Mean next-character loss on the held-out end of the text (one stream, no training)."""
    ids = corpus.held_out
    with torch.no_grad():
        logits, _ = model(ids[:-1].unsqueeze(0), None)
        return F.cross_entropy(logits[0], ids[1:]).item()


def detach(state: State) -> State:
    return state[0].detach(), state[1].detach()


def sample(model: SplitLanguageModel, corpus: CharCorpus, prompt: str, length: int) -> str:
    """Sampling (temperature 0.8) of ``length`` characters after ``prompt``."""
    gen = torch.Generator().manual_seed(0)
    ids = [corpus.index[c] for c in prompt if c in corpus.index] or [0]
    state: Optional[State] = None
    with torch.no_grad():
        logits, state = model(torch.tensor([ids]), state)
        out: List[int] = []
        for _ in range(length):
            probs = F.softmax(logits[0, -1] / 0.8, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
            out.append(nxt)
            logits, state = model(torch.tensor([[nxt]]), state)
    return corpus.decode(out)


def train(options: argparse.Namespace) -> None:
    """The trainer's role: build the split model and train it."""
    corpus = CharCorpus(options.text, options.batch_size)
    torch.manual_seed(options.seed)
    model = SplitLanguageModel(
        corpus.vocab_size, options.embedding_dim, options.hidden, options.layers, options.seed
    )
    opt = distopt.DistributedOptimizer(
        _launch.optimizer_class(options.optimizer), model.parameter_rrefs(), lr=options.lr
    )
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
    if options.schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=options.steps, eta_min=options.lr * 0.1
        )
    first_step = 1
    state: Optional[State] = None
    if options.checkpoint:
        _checkpoints.remove_unpublished(options.checkpoint)
    if options.resume_from:
        done, state = load_checkpoint(options.resume_from, model, opt, scheduler)
        first_step = done + 1
        print(f"resumed from {options.resume_from} after step {done}", flush=True)
    loss_log = open(options.loss_log, "a", encoding="utf-8") if options.loss_log else None
    print(
        f"{corpus.streams.numel()} characters, vocabulary {corpus.vocab_size}; "
        f"{options.optimizer}(lr={options.lr}) on {', '.join(WORKERS)} "
        f"(compiled: {opt.is_functional_optim}); schedule {options.schedule}, "
        f"clip {options.clip or 'off'}",
        flush=True,
    )
    print(
        f"uniform-guess loss {math.log(corpus.vocab_size):.3f}; held-out loss before training "
        f"{held_out_loss(model, corpus):.3f}",
        flush=True,
    )

    windows = corpus.windows(options.seq_len)
    for _ in range(first_step - 1):  # a resumed run reads the text from where it stopped
        _, _, restarted = next(windows)
    losses: List[float] = []
    norms: List[float] = []
    tokens_since, since = 0, time.perf_counter()
    start = since
    for step in range(first_step, options.steps + 1):
        inputs, targets, restarted = next(windows)
        if restarted:
            state = None
        with dist_autograd.context() as ctx:
            logits, state = model(inputs, state)
            loss = F.cross_entropy(logits.reshape(-1, corpus.vocab_size), targets.reshape(-1))
            dist_autograd.backward(ctx, [loss])
            if options.clip > 0:
                norms.append(float(opt.clip_grad_norm_(ctx, options.clip)))
            opt.step(ctx)
        if scheduler is not None:
            scheduler.step()
        state = detach(state)
        losses.append(loss.item())
        if loss_log is not None:  # exact values, one line per step (a redone step: again)
            loss_log.write(f"{step} {losses[-1].hex()}\n")
            loss_log.flush()
        tokens_since += targets.numel()
        if step % options.log_every == 0 or step == options.steps:
            now = time.perf_counter()
            recent = losses[-options.log_every :]
            rate = tokens_since / (now - since)
            norm = f"  grad-norm {sum(norms[-options.log_every:]) / max(1, len(norms[-options.log_every:])):.2f}" if norms else ""
            print(
                f"step {step:5d}  loss {sum(recent) / len(recent):.3f}  "
                f"held-out {held_out_loss(model, corpus):.3f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}{norm}  tokens/s {rate:6.0f}",
                flush=True,
            )
            tokens_since, since = 0, time.perf_counter()
        if options.checkpoint and (step % options.save_every == 0 or step == options.steps):
            folder = save_checkpoint(options.checkpoint, model, opt, scheduler, step, state,
                                     _checkpoints.options_of(options, RESUME_KEYS))
            print(f"checkpoint saved to {folder} after step {step}", flush=True)
        if step == options.stop_after:
            print(f"stopping after step {step} (--stop-after)", flush=True)
            break
    if loss_log is not None:
        loss_log.close()
    if not losses:
        print(f"nothing to do: the checkpoint is already at step {first_step - 1}", flush=True)
        return

    k = max(1, min(10, len(losses) // 4))
    first, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
    elapsed = time.perf_counter() - start
    print(
        f"loss: first {first:.3f} -> final {final:.3f} (mean of the first/last {k} steps); "
        f"held-out {held_out_loss(model, corpus):.3f}; {len(losses)} steps in {elapsed:.1f} s",
        flush=True,
    )
    if options.sample > 0:
        print("sample: " + repr(sample(model, corpus, "The ", options.sample)), flush=True)


def role(name: str, options: argparse.Namespace) -> None:
    """Run this process's part: the trainer trains; the parameter servers only serve."""
    if name == "trainer":
        train(options)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=350, help="training steps")
    parser.add_argument("--lr", type=float, default=5e-3, help="learning rate")
    parser.add_argument(
        "--optimizer", default="Adam", metavar="NAME",
        help=f"torch.optim class: {', '.join(_launch.OPTIMIZERS)} (not LBFGS: its step needs a "
        f"closure; not SparseAdam: sparse gradients only; not Muon: 2-D parameters only)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="LSTM state size")
    parser.add_argument("--layers", type=int, default=1, help="stacked LSTM layers")
    parser.add_argument("--embedding-dim", type=int, default=32, help="character embedding size")
    parser.add_argument("--batch-size", type=int, default=16, help="parallel text streams")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per step (BPTT)")
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    parser.add_argument("--sample", type=int, default=160, help="characters to sample at the end")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="UTF-8 training text")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="clip gradients to this global norm (0: off)")
    parser.add_argument("--schedule", choices=("cosine", "none"), default="cosine",
                        help="learning-rate schedule over --steps")
    parser.add_argument("--checkpoint", default="", help="directory for checkpoints (empty: none)")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint")
    parser.add_argument("--auto-resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint if there is "
                             "one, else start at step 1 (for torchrun --max-restarts)")
    parser.add_argument("--loss-log", default="", metavar="FILE",
                        help="append every step's loss to FILE, exactly ('STEP HEX' lines)")
    parser.add_argument("--stop-after", type=int, default=0,
                        help="stop after this step as if interrupted (0: run to --steps)")
    _launch.add_network_arguments(parser)
    options = parser.parse_args(argv)
    for flag in ("resume", "auto_resume"):
        if getattr(options, flag) and not options.checkpoint:
            parser.error(f"Invalid --{flag.replace('_', '-')}: given without --checkpoint "
                         f"(expected a directory)")
    try:
        options.resume_from = _checkpoints.resumable(options, TRAINER_FILE, RESUME_KEYS)
    except ValueError as exc:
        parser.error(str(exc))
    if options.clip < 0:
        parser.error(f"Invalid --clip: {options.clip!r} (expected >= 0)")
    for name in ("steps", "hidden", "layers", "embedding_dim", "batch_size", "seq_len", "log_every",
                 "save_every"):
        if getattr(options, name) < 1:
            parser.error(f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} (expected >= 1)")
    try:
        _launch.optimizer_class(options.optimizer)
    except ValueError as exc:
        parser.error(str(exc))
    return options


def main(argv: Optional[List[str]] = None) -> None:
    options = parse_args(argv)
    _launch.run(WORKERS, role, options)


if __name__ == "__main__":
    main()
