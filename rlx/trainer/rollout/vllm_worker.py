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

A LoRA policy pushes its adapters alone: between rlx_begin_adapter and rlx_finish_adapter
the loaded tensors are kept (under PEFT's names) instead of written into the model, then
made into one vLLM LoRA adapter, added to the worker's LoRA manager under the version's id.
The manager loads adapters it does not hold by reading a folder; rlx's ids are answered from
the adapters kept here instead (the newest few, as the engine says), so an adapter the
manager evicted comes back from memory too.

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
        pending = getattr(self, "_rlx_pending", None)
        if pending is not None:  # a LoRA push: kept on the host until the adapter is built
            from rlx.trainer.model.lora import peft_key

            for name, tensor in weights:
                pending[peft_key(name)] = tensor.detach().to("cpu", copy=True)
            return len(weights)
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

    def rlx_begin_adapter(self) -> None:
        self._rlx_pending: dict[str, Any] | None = {}

    def rlx_finish_adapter(self, adapter_id: int, config: dict[str, Any], keep: list[int]) -> int:
        """The pushed tensors made into adapter `adapter_id` (vLLM's LoRAModel, built as
        its own loader builds one from a folder) and loaded; adapters not in `keep` are
        unloaded. Returns the adapter's LoRA layers."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        tensors, self._rlx_pending = self._rlx_pending, None
        if not tensors:
            raise RuntimeError("rlx_finish_adapter: no adapter tensors were pushed")
        manager = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        helper.validate_legal(manager.lora_config)
        model = self._rlx_model()
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            adapter_id,
            tensors,
            helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        kept = self.__dict__.setdefault("_rlx_adapters", {})
        kept[adapter_id] = adapter
        self._rlx_answer_loads(manager, kept)
        for old in [i for i in kept if i not in keep]:
            kept.pop(old)
            manager.remove_adapter(old)
        manager.remove_adapter(adapter_id)  # a version pushed again: its new tensors, not the old
        manager.add_adapter(
            LoRARequest(f"rlx-{adapter_id}", adapter_id, f"rlx-memory://{adapter_id}")
        )
        return len(adapter.loras)

    @staticmethod
    def _rlx_answer_loads(manager: Any, kept: dict[int, Any]) -> None:
        """The manager's loader answers rlx's adapter ids from `kept` (once per worker)."""
        if getattr(manager, "_rlx_answers", False):
            return
        read_folder = manager._load_adapter

        def load(request: Any) -> Any:
            held = kept.get(request.lora_int_id)
            return held if held is not None else read_folder(request)

        manager._load_adapter = load
        manager._rlx_answers = True

    def rlx_join_weight_group(
        self, host: str, port: int, world_size: int, timeout_s: float, first_rank: int
    ) -> int:
        """Join the weight group as rank first_rank + this worker's rank; returns that rank."""
        from rlx.trainer.weights import GroupAddress, WeightGroup

        address = GroupAddress(host, port, world_size, timeout_s)
        rank = first_rank + int(self.rank)
        self._rlx_group = WeightGroup.join(address, rank, self._rlx_device())
        return rank

    def rlx_receive_push(
        self,
        layouts: list[dict[str, Any]],
        drop: int,
        skip: bool,
        adapter: tuple[int, dict[str, Any], list[int]] | None = None,
    ) -> int:
        """One push: every bucket received and loaded (unless a test hook says otherwise);
        the reload is finished (or, with `adapter`, rlx_finish_adapter's arguments, the
        adapter made) only when every tensor arrived. Returns the tensors loaded."""
        from rlx.trainer.weights import BucketLayout, receive_push

        group = getattr(self, "_rlx_group", None)
        if group is None:
            raise RuntimeError("rlx_receive_push before rlx_join_weight_group")
        plan = [BucketLayout.from_wire(layout) for layout in layouts]
        if not skip:
            if adapter is not None:
                self.rlx_begin_adapter()
            else:
                self.rlx_begin_reload()
        loaded = receive_push(group, plan, self.rlx_load, drop=drop, skip=skip)
        if not skip and loaded == sum(len(layout.names) for layout in plan):
            if adapter is not None:
                self.rlx_finish_adapter(*adapter)
            else:
                self.rlx_finish_reload()
        self._rlx_pending = None
        return loaded
