import pytest

from cute_kernels.config import FwdConfig, default_fwd_config


def test_defaults_validate_for_every_head_dim():
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            default_fwd_config(head_dim, causal).validate(head_dim)


@pytest.mark.parametrize("changes, field", [
    (dict(tile_m=96), "tile_m"), (dict(tile_m=256), "tile_m"), (dict(tile_n=20), "tile_n"),
    (dict(kv_stages=0), "kv_stages"), (dict(kv_stages=1), "kv_stages"),
    (dict(consumer_regs=250), "consumer_regs"), (dict(producer_regs=16), "producer_regs"),
    (dict(tile_m=192, consumer_regs=240), "consumer_regs"), (dict(kv_stages=4), "kv_stages"),
])
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"FwdConfig\.{field}: expected"):
        FwdConfig().replace(**changes).validate(128)


def test_smem_accounts_for_every_buffer():
    config = FwdConfig()
    # 2 stages of K and V (32 KB each) + Q + O (32 KB each) + 1 KB of barriers
    assert config.smem_bytes(128) == 1024 + 6 * 32 * 1024
