"""The vLLM plugin (entry point ``vllm.general_plugins``: ``trainer``): verifier logs from a vLLM server.

vLLM calls :func:`register` in each of its processes. It installs the CPU fix of vLLM's DFlash context keys
(:mod:`trainer.integrations.vllm.dflash_cpu`), TreeFlash serving
(:mod:`trainer.integrations.vllm.treeflash`) and SpecBlock serving (:mod:`trainer.integrations.vllm.specblock`)
and nothing else unless configured
(:mod:`trainer.integrations.vllm.config`); configured, it checks the vLLM release and installs the hooks of
:mod:`trainer.integrations.vllm.hooks`. Install into vLLM's own environment with ``.ci/vllm_env``.
"""

from __future__ import annotations

from trainer.integrations.vllm.config import PluginConfig


def register() -> None:
    from trainer.integrations.vllm.dflash_cpu import install as install_dflash_cpu
    from trainer.integrations.vllm.specblock import install as install_specblock
    from trainer.integrations.vllm.treeflash import install as install_treeflash

    install_dflash_cpu()
    install_treeflash()
    install_specblock()
    config = PluginConfig.from_env()
    if not config.enabled:
        return
    from trainer.integrations.vllm.hooks import install

    install(config)
