"""What rlx adds to each vLLM worker process (vLLM's `worker_extension_cls`): methods the
engine calls by name through `LLM.collective_rpc`, each running in every worker (one per
tensor-parallel rank) with the worker as `self`. Imported by vLLM inside its workers, so it
imports nothing heavy at module level.

Weights reach a worker in two ways. Over the weight group (split layout): the worker joins
the group once (rlx_join_weight_group), then each push is one call (rlx_receive_push) that
receives every bucket straight into a buffer of the worker's own device and loads the
tensors as views of it: no bytes in the RPC, no pickling. In-process (a colocated engine,
vLLM running in the training worker's own process): the tensors themselves are handed over
(rlx_load), on the device where the policy holds them.

Loading uses vLLM's layerwise reload: each layer takes checkpoint-format weights again and
is reprocessed into its kernel layout once all of its tensors have arrived (the CPU build
repacks linear weights after loading, so a plain load_weights cannot reach them).
"""

from __future__ import annotations

from typing import Any


class WeightReceiver:
    """Mixed into vLLM's worker class: `self` is the worker (model_runner, device, rank)."""

    model_runner: Any
    vllm_config: Any
    rank: int

    def rlx_seed(self, seed: int) -> None:
        """Requests without a seed of their own sample from the worker's global torch RNG."""
        import torch

        torch.manual_seed(seed)

    def _rlx_model(self) -> Any:
        return self.model_runner.get_model()

    def _rlx_device(self) -> Any:
        import torch

        device = getattr(self, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def rlx_begin_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self._rlx_model())

    def rlx_load(self, weights: list[tuple[str, Any]]) -> int:
        device = self._rlx_device()
        self._rlx_model().load_weights(weights=((name, t.to(device)) for name, t in weights))
        return len(weights)

    def rlx_finish_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._rlx_model()
        config = self.vllm_config.model_config
        finalize_layerwise_reload(model, config)
        # A head tied to the embeddings receives no weights of its own, so the reload never
        # reprocesses it: the CPU build's packed copy of it would keep the old embeddings.
        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        if getattr(config.hf_text_config, "tie_word_embeddings", False) and method is not None:
            method.process_weights_after_loading(lm_head)

    def rlx_join_weight_group(
        self, host: str, port: int, world_size: int, timeout_s: float, first_rank: int
    ) -> int:
        """Join the weight group as rank first_rank + this worker's rank; returns that rank."""
        from rlx.trainer.weights import GroupAddress, WeightGroup

        address = GroupAddress(host, port, world_size, timeout_s)
        rank = first_rank + int(self.rank)
        self._rlx_group = WeightGroup.join(address, rank, self._rlx_device())
        return rank

    def rlx_receive_push(self, layouts: list[dict[str, Any]], drop: int, skip: bool) -> int:
        """One push: every bucket received and loaded (unless a test hook says otherwise);
        the reload is finished only when every tensor arrived. Returns the tensors loaded."""
        from rlx.trainer.weights import BucketLayout, receive_push

        group = getattr(self, "_rlx_group", None)
        if group is None:
            raise RuntimeError("rlx_receive_push before rlx_join_weight_group")
        plan = [BucketLayout.from_wire(layout) for layout in layouts]
        if not skip:
            self.rlx_begin_reload()
        loaded = receive_push(group, plan, self.rlx_load, drop=drop, skip=skip)
        if not skip and loaded == sum(len(layout.names) for layout in plan):
            self.rlx_finish_reload()
        return loaded
