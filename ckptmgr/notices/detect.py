"""Which cloud is this? Local checks only (DMI files), no network, microseconds.

``"auto"`` sources are probed over the network only when one of these says yes, or when the
endpoint's environment variable is set, so start-up elsewhere never waits for a metadata server.
"""

from __future__ import annotations

from pathlib import Path

DMI_DIR = Path("/sys/class/dmi/id")
HYPERVISOR_UUID = Path("/sys/hypervisor/uuid")
#: The chassis asset tag of every Azure VM (what cloud-init and the Azure agent check).
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def on_gce(dmi_dir: Path = DMI_DIR) -> bool:
    """True on Google Compute Engine VMs (GKE nodes and Cloud TPU VMs included)."""
    return "Google" in _read(dmi_dir / "product_name") or _read(dmi_dir / "bios_vendor") == "Google"


def on_aws(dmi_dir: Path = DMI_DIR, hypervisor_uuid: Path = HYPERVISOR_UUID) -> bool:
    """True on EC2 instances (Nitro: "Amazon EC2" vendor; Xen: "amazon" BIOS or an ec2 UUID)."""
    names = ("sys_vendor", "bios_vendor", "bios_version")
    if any("amazon" in _read(dmi_dir / name).lower() for name in names):
        return True
    return _read(hypervisor_uuid).lower().startswith("ec2")


def on_azure(dmi_dir: Path = DMI_DIR) -> bool:
    """True on Azure VMs."""
    return _read(dmi_dir / "chassis_asset_tag") == AZURE_ASSET_TAG
