"""twinserve's scheduler plug-ins hosted in vLLM's V1 scheduler (docs/vllm-adapter.md).

host.py runs a plug-in over mirrors of vLLM's requests (pure Python), config.py composes and
builds it, scheduler.py is the vLLM `Scheduler` subclass that calls it (imported only inside
vLLM's process), cli.py is `twinserve-vllm` and venv.py makes the venv vLLM runs in."""

# vLLM's scheduler interface is not public: the versions the adapter was tested with.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def version_refusal(version: str) -> str | None:
    """One line refusing a vLLM `version` the adapter was not tested with, or None."""
    if version.split("+")[0] in SUPPORTED_VLLM_VERSIONS:
        return None
    return (f"vLLM {version} is not supported: the adapter was tested with vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)} only")
