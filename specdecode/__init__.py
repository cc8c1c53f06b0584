"""specdecode: lossless speculative decoding of large language models in plain PyTorch."""

from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.outputs import RequestOutput, SpecStats
from specdecode.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecDecodeError", "SpecStats"]
__version__ = "0.1.0"
