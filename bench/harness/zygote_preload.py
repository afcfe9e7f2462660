"""What the rank server of ``bench/harness/zygote.py`` imports once, for every rank it forks: torch with its
distributed, tracing and compiling stacks, this package, the libraries the checks build models from, and the example's
(the digits, its progress bar). Imports only: no tensor op, no thread."""

import rich.progress  # noqa: F401
import sklearn.datasets  # noqa: F401
import sklearn.model_selection  # noqa: F401
import torch  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.fx.experimental.proxy_tensor  # noqa: F401
import transformers.models.gpt2.modeling_gpt2  # noqa: F401
from torch.nn.parallel import DistributedDataParallel  # noqa: F401

import bench.harness.launch  # noqa: F401
import bench.tiny_models  # noqa: F401
import transpiler  # noqa: F401
