"""Checkpoints whose projection matrices are FP8 with a scale per block (DeepSeek-V3's and R1's
release, Qwen3's ``-FP8`` models; transformers' ``FineGrainedFP8Config``, DeepSeek-V3 report
arXiv:2412.19437 §3.3.2): each such matrix W (out, in) is stored as float8 e4m3 codes beside
``{name}_scale_inv`` (ceil(out / b_out), ceil(in / b_in)) float32, and W = codes x the scale of
its (b_out, b_in) block.

hx dequantizes each matrix as it is read (``Dequantized``), to float32, then holds it as asked
(``--dtype``, ``--weights``), tensor by tensor: the weights are the checkpoint's exactly, and the
products run on them as llama.cpp's converter and weight-only FP8 kernels (W8A16) run them; the
activations are not rounded to FP8 as DeepSeek's own inference code rounds them (W8A8).
Refused with one line: another ``quant_method``, ``fmt`` other than e4m3, static activation
scales, or no ``weight_block_size`` (one scale a tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from hx.errors import HxError
from hx.models.mapped import release

SCALE = "_scale_inv"  # the suffix of a matrix's block scales
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # safetensors' F8_E4M3


@dataclass(frozen=True)
class Fp8Blocks:
    """The block shape (b_out, b_in) of a checkpoint's FP8 matrices."""

    block: tuple[int, int]


def read_quantization(config: dict[str, Any], where: str) -> Fp8Blocks | None:
    """The ``quantization_config`` of a ``config.json`` dict, removed from it (the family
    readers refuse keys they do not know): None where there is none.

    Raises:
      HxError: a quantization hx does not read (module docstring), naming the field.
    """
    quant = config.pop("quantization_config", None)
    if quant is None:
        return None
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    for key, value in expected.items():
        if quant.get(key, value) != value:
            raise HxError(f"{where}: config.json's quantization_config sets {key}="
                          f"{quant.get(key)!r}; hx reads {key}={value!r} (FP8 weights with a "
                          "scale per block) and no other quantization")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block)):
        raise HxError(f"{where}: config.json's quantization_config sets weight_block_size="
                      f"{block!r}; hx reads FP8 weights with a scale per block of two sizes")
    unknown = sorted(set(quant) - set(expected) - {"weight_block_size",
                                                     "modules_to_not_convert"})
    if unknown:  # which modules are FP8 the tensors' own dtypes say
        raise HxError(f"{where}: config.json's quantization_config sets "
                      f"{', '.join(unknown)}, which hx does not implement")
    return Fp8Blocks((int(block[0]), int(block[1])))


def dequantize(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W (out, in) float32 = ``codes`` (out, in) float8 e4m3 x ``scale`` (ceil(out / b_out),
    ceil(in / b_in)) float32 of each code's block.

    Raises:
      HxError: ``scale``'s shape is not the blocks' of ``codes``.
    """
    out, n_in = codes.shape
    want = (-(-out // block[0]), -(-n_in // block[1]))
    if scale.shape != want:
        raise HxError(f"FP8 scales of shape {scale.shape} for a ({out}, {n_in}) matrix in "
                      f"blocks of {block}: expected {want}")
    full = np.repeat(np.repeat(scale.astype(np.float32), block[0], 0), block[1], 1)
    return codes.astype(np.float32) * full[:out, :n_in]


class Dequantized(Mapping):
    """A checkpoint's tensors by name, each FP8 matrix with block scales (``name`` and
    ``name + SCALE``) dequantized as it is read (``dequantize``; the mapped pages of its codes
    and scales then leave the resident set, ``models.mapped.release``), the others as they
    are."""

    def __init__(self, tensors: Mapping[str, np.ndarray], fp8: Fp8Blocks):
        self.tensors, self.fp8 = tensors, fp8

    def __getitem__(self, name: str) -> np.ndarray:
        array = self.tensors[name]
        if array.dtype != E4M3:
            return array
        if name + SCALE not in self.tensors:
            raise HxError(f"FP8 tensor {name} has no {name + SCALE}: the checkpoint is "
                          "incomplete")
        scale = self.tensors[name + SCALE]
        weights = dequantize(array, scale, self.fp8.block)
        release(array)
        release(scale)
        return weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
