"""Integrations with inference engines that run the project's code inside their own processes (vLLM: ``vllm``)."""
