"""The learner on several processes: ``torchrun`` ranks, DDP or FSDP, one ledger.

``torchrun --nproc-per-node N -m autodidact.cli learner ...`` starts N copies of the learner;
:class:`Ranks` is what each needs to know about the others. With ``WORLD_SIZE`` unset or 1
it is :data:`SINGLE`: every method returns its argument or does nothing, no process group
exists and the learner behaves exactly as one process always did.

What the ranks share, and how:

* **the batch** — each rank draws ``batch_groups / N`` groups from replay under its own
  learner id (``learner``, ``learner.r1``, ...), so the server's retry memory is per rank;
  the loss is scaled so that the step is the one a single process would take on all of them
  (see ``Learner._step``);
* **the weights** — DDP broadcasts rank 0's at wrap time and averages gradients, so the
  copies stay identical; FSDP (``fully_shard``, FSDP2) keeps one shard per rank and gathers
  a full state dict for publishing and checkpoints (:meth:`Ranks.model_state`). Checkpoints
  have the single-process format either way, so any world size resumes any other's;
* **the ledger** — every rank keeps the same list (ids all-gathered each update, in rank
  order); only rank 0 says hello to replay, commits, publishes, checkpoints and logs metrics;
* **stopping** — a rank that stops (signal, deadline, max updates) must stop the others, or
  they would wait forever in the next collective. Ranks agree through the process group's
  key-value store, not a collective, because a rank may wait minutes for its share of groups
  and a collective would time out meanwhile (:meth:`Ranks.agree_to_stop`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

MAIN_ID = "learner"
# Waiting for the others' share of a batch happens in the store, not in a collective, so the
# collective timeout only bounds real work (a step, a state-dict gather).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
POLL_S = 0.01


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    _store: object = field(default=None, repr=False)
    _round: int = 0  # draw rounds agreed so far: names this round's keys in the store

    @classmethod
    def from_env(cls) -> Ranks:
        """The ranks ``torchrun`` describes in the environment; :data:`SINGLE` without it."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return SINGLE
        return cls(rank=int(os.environ["RANK"]), world=world,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def member(self, base: str = MAIN_ID) -> str:
        """This rank's id towards replay: ``base`` on rank 0, ``base.r<rank>`` elsewhere."""
        return base if self.is_main else f"{base}.r{self.rank}"

    def share(self, batch_groups: int) -> int:
        if batch_groups % self.world:
            raise ValueError(f"learner.batch_groups ({batch_groups}) must be a multiple of the "
                             f"number of learner processes ({self.world})")
        return batch_groups // self.world

    # --- lifecycle -------------------------------------------------------------------------

    def device(self, name: str) -> torch.device:
        """``learner.device``, with ``cuda`` meaning this rank's own GPU (``LOCAL_RANK``)."""
        device = torch.device(name)
        if self.active and device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        return device

    def start(self, device: torch.device) -> Ranks:
        """Join the process group (NCCL between GPUs, gloo on CPU)."""
        if self.active and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT,
                                    device_id=device if device.type == "cuda" else None)
        if self.active:
            # The store torchrun's rendezvous set up: every rank reaches it without a collective.
            self._store = dist.PrefixStore("autodidact/",
                                           dist.distributed_c10d._get_default_store())
        return self

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()

    # --- models ----------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, parallel: str) -> torch.nn.Module:
        """The model to train: DDP (a full copy per rank) or FSDP2 (sharded per decoder
        layer, then the rest); the model itself with one process."""
        if not self.active:
            return model
        if parallel == "fsdp":
            return _shard(model)
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (rotary tables) are constants here: syncing them every forward would cost
        # a collective for nothing (they are synced once, at wrap time).
        return DistributedDataParallel(
            model, forward_sync_buffers=False,
            device_ids=[self.local_rank] if next(model.parameters()).is_cuda else None)

    def wrap_frozen(self, model: torch.nn.Module, parallel: str) -> torch.nn.Module:
        """A forward-only model (the KL reference): sharded too under FSDP, else as is."""
        return _shard(model) if self.active and parallel == "fsdp" else model

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        return model.module if _is_ddp(model) else model

    @contextlib.contextmanager
    def sync_grads(self, model: torch.nn.Module, sync: bool):
        """Around one micro-batch's forward and backward: gradients are averaged over ranks
        only when ``sync`` (the last micro-batch of a step); before that they accumulate
        locally, which is what gradient accumulation needs and saves the communication."""
        if not self.active:
            yield
            return
        if _is_ddp(model) and not sync:
            with model.no_sync():
                yield
            return
        if _is_fsdp(model):
            model.set_requires_gradient_sync(sync)
        yield

    @staticmethod
    def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
        """Clip the global gradient (DDP's is the averaged one, FSDP's spans the shards)."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def model_state(self, model: torch.nn.Module, trainable_only: bool = False) -> dict | None:
        """The full state dict on rank 0 (None elsewhere), keyed as the unwrapped model's;
        with ``trainable_only`` only the parameters that train (a LoRA adapter: the frozen
        base is then never gathered). Under FSDP every rank must call it."""
        if _is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            options = _full_options(cpu_offload=True, ignore_frozen_params=trainable_only)
            state = get_model_state_dict(model, options=options)
            if trainable_only:  # a tied frozen weight (lm_head) slips through the option
                names = set(_param_names(model))
                state = {k: v for k, v in state.items() if k in names}
            return state if self.is_main else None
        if not self.is_main:
            return None
        module = self.unwrap(model)
        if not trainable_only:
            return module.state_dict()
        return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}

    def optimizer_state(self, model: torch.nn.Module, optimizer) -> dict | None:
        """The optimizer's full state on rank 0 (None elsewhere), in the single-process
        format (parameters by index), so any world size can resume it."""
        if not _is_fsdp(model):
            return optimizer.state_dict() if self.is_main else None
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
        if not self.is_main:
            return None
        index = {name: i for i, name in enumerate(_param_names(model))}
        return _rekey(state, index.__getitem__)

    def load_model_state(self, model: torch.nn.Module, state: dict,
                         partial: bool = False) -> None:
        """Load a full state dict, present on every rank (each read the checkpoint). With
        ``partial`` only the trainable parameters must be in it (a LoRA adapter's): the
        frozen rest stays as loaded from the base."""
        if _is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            result = set_model_state_dict(model, state, options=_full_options(strict=not partial))
        else:
            result = self.unwrap(model).load_state_dict(state, strict=not partial)
        if partial:
            trainable = {n for n, p in self.unwrap(model).named_parameters() if p.requires_grad}
            missing = sorted(trainable & set(result.missing_keys))
            if missing or result.unexpected_keys:
                raise ValueError(f"the saved state does not fit the trainable parameters: "
                                 f"missing {missing[:3]}, unexpected "
                                 f"{sorted(result.unexpected_keys)[:3]}")

    def load_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        if not _is_fsdp(model):
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        names = _param_names(model)
        set_optimizer_state_dict(model, optimizer, _rekey(state, names.__getitem__),
                                 options=_full_options())

    # --- collectives -----------------------------------------------------------------------

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` summed over ranks (one all-reduce; same keys on every rank)."""
        if not self.active:
            return values
        flat = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                            device=self._collective_device())
        dist.all_reduce(flat)
        return dict(zip(values, flat.tolist()))

    def max_int(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        if not self.active:
            return int(value)
        flat = torch.tensor([int(value)], dtype=torch.long, device=self._collective_device())
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        return int(flat.item())

    def gather_strings(self, items: list[str]) -> list[str]:
        """Every rank's ``items``, concatenated in rank order, on every rank. JSON in a byte
        tensor: all_gather_object would unpickle what the others send."""
        if not self.active:
            return list(items)
        device = self._collective_device()
        data = torch.frombuffer(bytearray(json.dumps(items).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], device=device))
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:len(data)] = data.to(device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        out: list[str] = []
        for part, size in zip(parts, sizes):
            out += json.loads(bytes(part[:int(size)].cpu().tolist()).decode())
        return out

    def agree(self, value: str) -> bool:
        """Whether every rank holds the same ``value``."""
        return len(set(self.gather_strings([value]))) == 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # --- stopping together ------------------------------------------------------------------

    def peer_stopped(self) -> bool:
        """Whether another rank decided to stop in this draw round (cheap: one store lookup)."""
        return self.active and self._store.check([self._key("stop")])

    def agree_to_stop(self, stop_here: bool) -> bool:
        """Called once per draw round by every rank, after drawing its share (``False``) or
        deciding to stop (``True``): whether all stop. Returns once every rank has called it;
        a rank still drawing sees the stop through :meth:`peer_stopped` and calls it too."""
        if not self.active:
            return stop_here
        if stop_here:
            self._store.set(self._key("stop"), "1")  # before "ready": seen by all who see that
        self._store.set(self._key(f"ready/{self.rank}"), "1")
        everyone = [self._key(f"ready/{r}") for r in range(self.world)]
        while not self._store.check(everyone):
            time.sleep(POLL_S)
        stop = self._store.check([self._key("stop")])
        if self._round >= 2:  # every rank is past that round's check by now
            self._store.delete_key(f"{self._round - 2}/ready/{self.rank}")
        self._round += 1
        return stop

    def _key(self, name: str) -> str:
        return f"{self._round}/{name}"

    def _collective_device(self) -> torch.device:
        # NCCL moves only CUDA tensors; gloo takes CPU ones.
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


SINGLE = Ranks()


def _is_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 in place: each transformer block its own unit (gathered only while it runs),
    then the root for what is left (embeddings, tied head, final norm)."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    return model


def _full_options(cpu_offload: bool = False, strict: bool = True,
                  ignore_frozen_params: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict,
                            ignore_frozen_params=ignore_frozen_params)


def _param_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters the optimizer holds (the trainable ones), in ``parameters()``
    order, the order of its indexes (``fully_shard`` keeps both names and order)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _rekey(state: dict, key) -> dict:
    """An optimizer state dict with every parameter key mapped through ``key``."""
    groups = [{**g, "params": [key(p) for p in g["params"]]} for g in state["param_groups"]]
    return {"state": {key(p): s for p, s in state["state"].items()}, "param_groups": groups}
