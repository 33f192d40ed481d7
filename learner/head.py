"""The policy's log-probs and entropy at the positions that are trained, a chunk of them at a time.

veRL's FSDP engine runs the Hugging Face forward, which projects every position of a micro-batch
onto the vocabulary, and then takes log-probs and entropy from those ``[tokens x vocab]`` logits.
A search agent's sample is mostly observation tokens (search results, pages), which are never
trained, and at 64k tokens and a 150k vocabulary the logits alone are tens of gigabytes.

Installed on a training worker (:func:`install`), the model's forward stops at the hidden states;
only the positions whose next token the policy generated (``response_mask`` 1) go through the LM
head, ``chunk`` positions at a time, and each chunk is recomputed in the backward pass
(``torch.utils.checkpoint``), so the head holds ``chunk x vocab`` values whatever the length. The
values come from the functions veRL itself applies (``logprobs_from_logits``,
``entropy_from_logits``), on fewer rows; every other position gets 0, which every loss, the KL term
and the entropy bonus mask out. Gradients agree with the whole-logits path to float rounding
(the head's weight gradient sums over fewer rows, in another order).

It plugs into the contract veRL keeps for fused kernels: where a micro-batch says
``use_fused_kernels``, the engine takes ``log_probs`` and ``entropy`` from the model's output
instead of logits (padded and packed layouts both). The learner sets that key per batch
(:mod:`turnstile.learner.trainer`); a batch without it runs the model's own forward, so both paths live in
one worker (the equality tests use that).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

TRAINED = "turnstile_trained"  # the model input that marks the trained positions
ENTROPY = "turnstile_entropy"  # the model input that asks for the entropy too


def trained_positions(micro_batch: Any) -> torch.Tensor:  # noqa: ANN401 - veRL's TensorDict
    """A bool per token of the micro-batch's packed ``input_ids`` (``.values()``): True at position
    t of a sequence where token t + 1 is one the policy generated. Response token j of a sample with
    a prompt of p tokens is predicted at position p - 1 + j (as veRL slices responses out of the
    model's outputs: ``no_padding_2_padding``)."""
    offsets = micro_batch["input_ids"].offsets()
    prompts, response_mask = micro_batch["prompts"], micro_batch["response_mask"]
    if prompts.is_nested:
        prompt_lens = prompts.offsets().diff()
    else:
        prompt_lens = micro_batch["attention_mask"][:, :prompts.shape[1]].sum(dim=1)
    if response_mask.is_nested:
        response_mask = response_mask.to_padded_tensor(0)
    rows, columns = response_mask.bool().nonzero(as_tuple=True)
    flat = torch.zeros(int(offsets[-1]), dtype=torch.bool, device=offsets.device)
    flat[offsets[rows] + prompt_lens[rows] - 1 + columns] = True
    return flat


def packed_trained(flat: torch.Tensor, pad: int, sequence_parallel: int) -> torch.Tensor:
    """:func:`trained_positions` laid out as the engine lays out the packed labels it passes the
    model (``shift_labels``): the global packed sequence padded by ``pad`` at the end and, with
    sequence parallelism, this rank's contiguous slice of it, as ``(1, tokens)``."""
    mask = torch.nn.functional.pad(flat, (0, pad)).unsqueeze(0)
    if sequence_parallel > 1:
        from verl.utils.ulysses import slice_input_tensor

        mask = slice_input_tensor(mask, dim=1, padding=False)
    return mask


def head_values(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                chunk: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and the entropy) under ``hidden @ weight.T + bias``, ``chunk`` rows at
    a time, each chunk's logits recomputed in backward instead of kept."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    def one(rows: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(rows, weight, bias)
        log_probs = logprobs_from_logits(logits, targets, inplace_backward=not entropy)
        return (log_probs, entropy_from_logits(logits)) if entropy else (log_probs,)

    parts = []
    for start in range(0, hidden.shape[0], chunk):
        rows, targets = hidden[start:start + chunk], labels[start:start + chunk]
        if torch.is_grad_enabled():
            parts.append(checkpoint(one, rows, targets, use_reentrant=False))
        else:
            parts.append(one(rows, targets))
    log_probs = torch.cat([part[0] for part in parts])
    return log_probs, (torch.cat([part[1] for part in parts]) if entropy else None)


def _head_forward(self: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                  chunk: int = 0, entropy: bool = False) -> Any:  # noqa: ANN401 - logits or (log-probs, entropy)
    """``lm_head``'s forward: the logits as before, or with ``labels`` the chunked values in one call
    of the module (an FSDP2-wrapped head gathers its weight once per call, and every rank makes the
    same number of calls)."""
    if labels is None:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)
    return head_values(hidden, labels, self.weight, self.bias, chunk, entropy)


def _model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the model's own signature
        trained = kwargs.pop(TRAINED, None)
        entropy = bool(kwargs.pop(ENTROPY, False))
        if trained is None:  # a batch on veRL's own path
            return original(self, *args, **kwargs)
        from verl.models.transformers.dense_common import CausalLMOutputForPPO

        temperature = kwargs.pop("temperature", 1.0)
        if temperature != 1.0:
            raise ValueError(f"the learner's chunked head computes log-probs at temperature 1, not {temperature}")
        shift_labels = kwargs.pop("shift_labels", None)
        kwargs.pop("return_dict", None)
        kwargs.pop("use_cache", None)
        input_ids = kwargs.pop("input_ids")
        hidden = self.model(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
        labels = shift_labels if shift_labels is not None else torch.roll(input_ids, shifts=-1, dims=-1)
        where = trained.reshape(-1).nonzero().squeeze(1)
        none = not where.numel()
        if none:  # one row all the same: the graph and the head's collectives stay those of other ranks
            where = where.new_zeros(1)
        log_probs, entropies = self.lm_head(hidden.reshape(-1, hidden.shape[-1])[where], labels.reshape(-1)[where],
                                            chunk=self.turnstile_chunk, entropy=entropy)

        def spread(values: torch.Tensor) -> torch.Tensor:
            values = values * 0 if none else values
            return values.new_zeros(labels.numel()).index_put((where,), values).view(labels.shape)

        # veRL annotates FloatTensor, the legacy type of a float tensor.
        return CausalLMOutputForPPO(log_probs=spread(log_probs),  # type: ignore[arg-type]
                                    entropy=spread(entropies) if entropies is not None else None)  # type: ignore[arg-type]

    return forward


def _inputs_with_trained(engine: Any, original: Callable[..., Any]) -> Callable[..., Any]:  # noqa: ANN401
    from verl.utils import tensordict_utils as tu

    def prepare_model_inputs(micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:  # noqa: ANN401
        model_inputs, output_args = original(micro_batch=micro_batch)
        if not tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            return model_inputs, output_args
        flat = trained_positions(micro_batch)
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            mask = packed_trained(flat, int(output_args.get("pad_size", 0) or 0),
                                  getattr(engine, "ulysses_sequence_parallel_size", 1))
        else:
            offsets = micro_batch["input_ids"].offsets()
            nested = torch.nested.nested_tensor_from_jagged(flat.to(torch.uint8), offsets)
            mask = nested.to_padded_tensor(0, output_size=tuple(model_inputs["input_ids"].shape)).bool()
        model_inputs[TRAINED] = mask
        model_inputs[ENTROPY] = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        return model_inputs, output_args

    return prepare_model_inputs


def install(engine: Any, chunk: int) -> None:  # noqa: ANN401 - veRL's FSDP engine
    """Give ``engine``'s model the chunked head, for batches that set ``use_fused_kernels``; a
    second call changes the chunk."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: the head takes at least one position at a time")
    module = engine.module
    if getattr(module, "turnstile_chunk", None) is None:
        head = module.lm_head
        head.forward = types.MethodType(_head_forward, head)
        model_class = type(module)  # after fully_shard, a class of this model alone
        model_class.forward = _model_forward(model_class.forward)
        engine.prepare_model_inputs = _inputs_with_trained(engine, engine.prepare_model_inputs)
    module.turnstile_chunk = chunk
