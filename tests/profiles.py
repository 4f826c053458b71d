"""A fixed GPU-like hardware profile for planner tests (plain numbers, not measured)."""

from hx.planner.profile import DeviceProfile, HardwareProfile


def gpu_like() -> HardwareProfile:
    """An accelerator ~20x the host in matmul rate and 10x in bandwidth, over a 16 GB/s link
    (a PCIe 4 x16 GPU beside a few CPU cores)."""
    ms = (1, 4, 16, 64, 256, 1024)
    acc = DeviceProfile(matmul=tuple((m, min(2.5e11 * m, 6e13)) for m in ms),
                        memory_bandwidth=5e11, attention=((256, 4e11), (4096, 4.5e11)),
                        launch_overhead=((1, 2e-5),))
    host = DeviceProfile(matmul=tuple((m, min(1.25e10 * m, 1e12)) for m in ms),
                         memory_bandwidth=5e10, attention=((256, 3e10), (4096, 4e10)),
                         launch_overhead=((1, 2e-5),))
    return HardwareProfile(name="gpu-like test profile", accelerator=acc, host=host,
                           h2d_bandwidth=1.6e10, d2h_bandwidth=1.6e10, transfer_latency=1e-5,
                           contention=0.1, sync_overhead=2e-5)


# Planning tests plan for a GPU machine whose host holds whatever the accelerator does not:
# a host budget larger than any model's bytes (``discover``'s default is this machine's).
LARGE_HOST = 2**50
