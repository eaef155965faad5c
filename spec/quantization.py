"""Weight-only quantization as data (SPEC §15): the layouts the spec defines, read exactly, and
dequantized so the golden can run on a quantized model's own stored tensors.

One layout so far, onnxruntime's MatMulNBits (com.microsoft): Y = A · dequantize(B)ᵀ for a
weight W [K, N] stored transposed, block-wise along the reduction axis K:

    codes        uint8 [N, ⌈K/B⌉, B·bits/8]   column n's block b of K, `bits` per code, packed
                                               from the low bits of each byte up (4 bits: element
                                               2i in the low nibble, 2i+1 in the high one)
    scales       [N, ⌈K/B⌉] (or flattened)     one per column and block, in the activations' dtype
    zero_points  uint8 [N, ⌈⌈K/B⌉·bits/8⌉] packed the same way along the blocks (or flattened),
                 or absent: 2^(bits−1) (symmetric)
    W[k, n] = (code − zero_point) · scale      for k in block b = k // B, the padding past K dropped

A layout the spec does not define (another bit width, a zero point in a float dtype, a scale
missing or misshapen) is refused with the field named, never dequantized approximately.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec.errors import WeightsError

BITS = (4, 8)  # the code widths the spec reads; MatMulNBits has 2 too, which it refuses by name


@dataclass(frozen=True)
class BlockQuantized:
    """One weight W [K, N] in MatMulNBits' layout (the module docstring): K and N, the code width,
    the block size B along K, and the stored tensors as the graph holds them."""

    k: int
    n: int
    bits: int
    block_size: int
    codes: np.ndarray  # uint8 [N, blocks, B·bits/8]
    scales: np.ndarray  # [N, blocks] or [N·blocks]
    zero_points: np.ndarray | None = None  # uint8 [N, ⌈blocks·bits/8⌉] or flattened; None: 2^(bits−1)

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block_size)


def check_block_quantized(weight: BlockQuantized, name: str = "weight") -> None:
    """Every field of a MatMulNBits weight as SPEC §15 defines it, else WeightsError naming the field."""
    if weight.bits not in BITS:
        raise WeightsError(f"{name}: bits = {weight.bits}; the spec reads {' and '.join(map(str, BITS))}-bit codes "
                           "(MatMulNBits' 2-bit layout is not defined here)")
    if weight.k < 1 or weight.n < 1:
        raise WeightsError(f"{name}: K = {weight.k}, N = {weight.n}; both must be positive")
    if weight.block_size < 16 or weight.block_size & (weight.block_size - 1):
        raise WeightsError(f"{name}: block_size = {weight.block_size}; MatMulNBits' blocks are a power of 2, at least 16")
    per_byte = 8 // weight.bits
    want = (weight.n, weight.blocks, weight.block_size // per_byte)
    if weight.codes.dtype != np.uint8 or weight.codes.shape != want:
        raise WeightsError(f"{name}: codes are {weight.codes.dtype} {list(weight.codes.shape)}; "
                           f"K {weight.k}, N {weight.n}, {weight.bits} bits in blocks of {weight.block_size} "
                           f"need uint8 {list(want)}")
    if weight.scales.dtype.kind != "f" or weight.scales.size != weight.n * weight.blocks \
            or weight.scales.shape not in ((weight.n, weight.blocks), (weight.n * weight.blocks,)):
        raise WeightsError(f"{name}: scales are {weight.scales.dtype} {list(weight.scales.shape)}; one float per "
                           f"column and block: [{weight.n}, {weight.blocks}] (or flattened)")
    if weight.zero_points is not None:
        packed = -(-weight.blocks // per_byte)
        if weight.zero_points.dtype != np.uint8:
            raise WeightsError(f"{name}: zero_points are {weight.zero_points.dtype}; the spec reads them packed in "
                               "uint8 as the codes are (a zero point in the scales' float dtype is not defined here)")
        if weight.zero_points.shape not in ((weight.n, packed), (weight.n * packed,)):
            raise WeightsError(f"{name}: zero_points are {list(weight.zero_points.shape)}; {weight.blocks} block(s) of "
                               f"{weight.bits} bits per column pack into [{weight.n}, {packed}] (or flattened)")


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., M] -> the codes [..., M·8/bits], each byte's low bits first."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits  # [per_byte]
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [..., M, per_byte]
    return codes.reshape(*packed.shape[:-1], -1)


def block_elements(weight: BlockQuantized) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[K, N] each element's code (int64), its block's scale (float64, signed as stored) and its
    zero point (int64; 2^(bits−1) where none is stored), the padding past K dropped."""
    check_block_quantized(weight)

    def per_element(per_block: np.ndarray) -> np.ndarray:  # [N, blocks] -> [K, N]
        return np.repeat(per_block, weight.block_size, axis=1)[:, :weight.k].T

    codes = unpack(weight.codes, weight.bits).reshape(weight.n, -1)[:, :weight.k].T.astype(np.int64)
    scales = np.asarray(weight.scales, np.float64).reshape(weight.n, weight.blocks)
    zero = (np.full((weight.n, weight.blocks), 2 ** (weight.bits - 1), np.int64) if weight.zero_points is None else
            unpack(weight.zero_points.reshape(weight.n, -1), weight.bits)[:, :weight.blocks].astype(np.int64))
    return codes, per_element(scales), per_element(zero)


def dequantize(weight: BlockQuantized) -> np.ndarray:
    """W [K, N] in float64: (code − zero_point) · scale per column and block of K."""
    codes, scales, zero = block_elements(weight)
    return (codes - zero).astype(np.float64) * scales


@dataclass(frozen=True)
class RowQuantized:
    """One weight W [K, N] as torchao's weight-only int8 (Int8Tensor) holds it: codes int8 [N, K] (torch's
    Linear layout, [out, in]), one scale per output row [N, 1] (or [N]), zero points 0 (or absent):
    W[k, n] = code[n, k] · scale[n]."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None


def dequantize_rows(weight: RowQuantized, name: str = "weight") -> np.ndarray:
    """W [K, N] in float64 from a row-quantized weight; a layout other than RowQuantized's refused by name."""
    if weight.codes.dtype != np.int8 or weight.codes.ndim != 2:
        raise WeightsError(f"{name}: codes are {weight.codes.dtype} {list(weight.codes.shape)}; the spec reads int8 "
                           "[out, in]")
    rows = weight.codes.shape[0]
    if weight.scales.dtype.kind != "f" or weight.scales.shape not in ((rows, 1), (rows,)):
        raise WeightsError(f"{name}: scales are {weight.scales.dtype} {list(weight.scales.shape)}; one float per "
                           f"output row: [{rows}, 1]")
    if weight.zero_points is not None and np.any(weight.zero_points):
        raise WeightsError(f"{name}: zero points other than 0; the spec reads symmetric row quantization only")
    scales = np.asarray(weight.scales, np.float64).reshape(rows, 1)
    return (weight.codes.astype(np.float64) * scales).T  # [K, N]


# onnxruntime's MatMulNBits compute modes the tolerance policy covers (SPEC §15.1): 0 the activations in
# their float dtype, 4 rounded to int8 per block before the product
ACCURACY_LEVELS = (0, 4)


@dataclass(frozen=True)
class QuantizationScheme:
    """What a weight-only deployment quantizes, and how (SPEC §15): every linear layer's weight
    [in, out] at `bits`, in blocks of `block_size` along its input axis, symmetric (zero point
    2^(bits−1)) or with a zero point per block; the head at `head_bits` (None: left in float); the
    embeddings stay float (a lookup, no matrix product). `accuracy_level`: onnxruntime's MatMulNBits
    compute mode: 0 (the activations in their float dtype) or 4 (rounded to int8 per block of K before
    each product: the policy's int8-activations mode).
    `dynamic`: onnxruntime's dynamic quantization instead (quantize_dynamic: int8 weights, one scale
    per tensor, and the activations quantized to int8 at run time, MatMulInteger), whose products the
    golden does not compute: only its cost is measured (SPEC §15.1).
    `builder`: who quantizes and runs: "onnxruntime" (our export through its quantizer), "torchao"
    (impl_torch's linear layers through torchao's weight-only int8: TORCHAO_INT8, a scale per row),
    "onnxruntime-genai" (its model builder's `-p int4` from a Hugging Face directory: GENAI_INT4), or
    CTranslate2's converter and Generator at compute type int8 or int8_float32 (CTRANSLATE2_INT8: its
    weights int8 with a scale per row, its activations quantized at run time: the cost only)."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    head_bits: int | None = None
    accuracy_level: int = 0
    dynamic: bool = False
    builder: str = "onnxruntime"

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS:
            raise WeightsError(f"quantization builder = {self.builder!r}; one of {', '.join(BUILDERS)}")
        if self.builder == "onnxruntime-genai" and (self.bits, self.block_size, self.symmetric, self.head_bits,
                                                    self.accuracy_level, self.dynamic) != (4, 32, True, 4, 4, False):
            raise WeightsError("onnxruntime-genai's builder writes one scheme here, its -p int4 (genai-int4: 4 bits "
                               "in blocks of 32, symmetric, the head too, accuracy_level 4)")
        if self.builder == "torchao" and (self.bits, self.symmetric, self.head_bits, self.accuracy_level,
                                          self.dynamic) != (8, True, None, 0, False):
            raise WeightsError("torchao: its weight-only int8 (Int8WeightOnlyConfig) is read here: 8 bits, symmetric, "
                               "one scale per row, the head left float (torchao-int8)")
        if self.builder.startswith("ctranslate2") and (self.bits, self.head_bits, self.dynamic) != (8, 8, True):
            raise WeightsError(f"{self.builder}: CTranslate2's int8 quantizes every linear layer, the head too, and "
                               "its activations at run time (bits 8, head_bits 8, dynamic)")
        if not isinstance(self.dynamic, bool):
            raise WeightsError(f"quantization dynamic = {self.dynamic!r}; true or false")
        if self.dynamic and (self.bits, self.head_bits or 8, self.symmetric) != (8, 8, True):
            raise WeightsError(f"dynamic quantization at bits {self.bits}, head_bits {self.head_bits}, symmetric "
                               f"{self.symmetric}: onnxruntime's is int8, symmetric (dynamic-int8, dynamic-int8-head8)")
        for field, value in (("bits", self.bits), ("head_bits", self.head_bits)):
            if value is not None and (isinstance(value, bool) or value not in BITS):
                raise WeightsError(f"quantization {field} = {value!r}; the spec reads "
                                   f"{' and '.join(map(str, BITS))}-bit codes")
        if self.bits is None:
            raise WeightsError("quantization bits = None; every linear layer is quantized: give 4 or 8")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 16 \
                or self.block_size & (self.block_size - 1):
            raise WeightsError(f"quantization block_size = {self.block_size!r}; MatMulNBits' blocks are a power of 2, "
                               "at least 16")
        if not isinstance(self.symmetric, bool):
            raise WeightsError(f"quantization symmetric = {self.symmetric!r}; true or false")
        if self.accuracy_level not in ACCURACY_LEVELS or isinstance(self.accuracy_level, bool):
            raise WeightsError(f"quantization accuracy_level = {self.accuracy_level!r}; the tolerance policy covers "
                               "levels 0 (the activations in their float dtype) and 4 (rounded to int8)")
        if self.dynamic and self.accuracy_level:
            raise WeightsError("a dynamic scheme has no accuracy_level: its activations are int8 anyway")

    @property
    def name(self) -> str:
        """int4-b32-sym, int8-b128-zp-head8, dynamic-int8, genai-int4: the column's name."""
        if self.builder == "onnxruntime-genai":
            return "genai-int4"
        if self.builder.startswith("ctranslate2"):
            return self.builder
        if self.builder == "torchao":
            return "torchao-int8"
        head = f"-head{self.head_bits}" if self.head_bits else ""
        if self.dynamic:
            return f"dynamic-int8{head}"
        level = f"-al{self.accuracy_level}" if self.accuracy_level else ""
        return f"int{self.bits}-b{self.block_size}-{'sym' if self.symmetric else 'zp'}{head}{level}"


BUILDERS = ("onnxruntime", "onnxruntime-genai", "ctranslate2-int8", "ctranslate2-int8_float32", "torchao")
# what onnxruntime-genai's model builder writes at -p int4 on the CPU (measured: MatMulNBits of 4 bits in blocks
# of 32 without zero points at accuracy_level 4, the head among them, a tied embedding read from the head's codes)
GENAI_INT4 = QuantizationScheme(4, 32, True, head_bits=4, accuracy_level=4, builder="onnxruntime-genai")
# torchao's Int8WeightOnlyConfig on impl_torch's linear layers: int8 codes, one scale per output row (no block
# size: `per_row`), activations float32; the head (not an nn.Linear) left float
TORCHAO_INT8 = QuantizationScheme(8, builder="torchao")
CTRANSLATE2_INT8 = {compute_type: QuantizationScheme(8, head_bits=8, dynamic=True, builder=f"ctranslate2-{compute_type}")
                    for compute_type in ("int8", "int8_float32")}


def quantized_parameters(cfg, scheme: QuantizationScheme) -> dict[str, int]:
    """The parameters a scheme quantizes, with their code width: every linear layer's weight [in, out]
    (2-D, not an embedding) at scheme.bits, and `head.weight` at head_bits where set (a tied head
    too, stored then as a head of its own); the embeddings stay float."""
    from spec.params import param_shapes

    wanted = {name: scheme.bits for name, shape in param_shapes(cfg).items()
              if len(shape) == 2 and not name.endswith("embed.weight") and name != "head.weight"}
    if scheme.head_bits is not None:
        wanted["head.weight"] = scheme.head_bits
    return wanted


def parse_scheme(text: str) -> QuantizationScheme:
    """A scheme by its name (QuantizationScheme.name): int4 or int8, then any of -b<block size>
    (default 32), -sym or -zp (default symmetric), -head4 or -head8 (default: the head left float):
    'int4', 'int8-b128-zp', 'int4-b32-sym-head8', -al4 for onnxruntime's accuracy_level 4; or
    dynamic-int8[-head8]; or genai-int4 (onnxruntime-genai's builder); or ctranslate2-int8,
    ctranslate2-int8_float32 (CTranslate2's compute types); or torchao-int8. An unknown part is refused
    by name."""
    if text.strip().lower() == "torchao-int8":
        return TORCHAO_INT8
    if text.strip().lower().startswith("ctranslate2"):
        compute_type = text.strip().lower().removeprefix("ctranslate2").removeprefix("-")
        if compute_type not in CTRANSLATE2_INT8:
            raise WeightsError(f"quantization scheme {text!r}: CTranslate2's are ctranslate2-int8 and "
                               "ctranslate2-int8_float32 (its compute types)")
        return CTRANSLATE2_INT8[compute_type]
    parts = text.strip().lower().split("-")
    if parts[0] == "genai":
        if parts[1:] != ["int4"]:
            raise WeightsError(f"quantization scheme {text!r}: onnxruntime-genai's builder is read at genai-int4 (its "
                               "-p int4)")
        return GENAI_INT4
    if parts[0] == "dynamic":  # dynamic-int8[-head8]
        if parts[1:2] != ["int8"] or parts[2:] not in ([], ["head8"]):
            raise WeightsError(f"quantization scheme {text!r}: onnxruntime's dynamic quantization is dynamic-int8, "
                               "or dynamic-int8-head8 with the head")
        return QuantizationScheme(bits=8, head_bits=8 if parts[2:] else None, dynamic=True)
    if not parts[0].startswith("int") or not parts[0][3:].isdigit():
        raise WeightsError(f"quantization scheme {text!r}: it starts with int4 or int8 (the code width)")
    fields: dict = {"bits": int(parts[0][3:])}
    for part in parts[1:]:
        if part in ("sym", "zp"):
            fields["symmetric"] = part == "sym"
        elif part.startswith("b") and part[1:].isdigit():
            fields["block_size"] = int(part[1:])
        elif part.startswith("head") and part[4:].isdigit():
            fields["head_bits"] = int(part[4:])
        elif part.startswith("al") and part[2:].isdigit():
            fields["accuracy_level"] = int(part[2:])
        else:
            raise WeightsError(f"quantization scheme {text!r}: {part!r} is none of b<block size>, sym, zp, "
                               "head<bits>, al<accuracy level>")
    return QuantizationScheme(**fields)
