"""The benchmark model zoo, kept here for scripts that ``from zoo import ZOO``: it lives in the
package as ``hrockmate.zoo`` (what ``hrockmate bench`` uses)."""

from hrockmate.zoo import SIZES, ZOO, MLPMixer, mlp_mixer

__all__ = ["SIZES", "ZOO", "MLPMixer", "mlp_mixer"]
