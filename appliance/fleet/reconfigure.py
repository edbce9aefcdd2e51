"""Applies the config file to the running server: one change at a time.

Whoever changed the file (the admin API, the CLI through appliance.config.writer, the operator by
hand) asks for it to be applied; the file is read and checked as at start, the difference is
decided by appliance/fleet/change.py, and the registry switches the fleet. A file that does not
parse, or a model that cannot be made, leaves the running fleet as it was.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from appliance.config.settings import load_settings
from appliance.config.writer import restore
from appliance.fleet.admin import ModelAdminError
from appliance.fleet.change import FleetChange, fleet_change, new_key_destinations, running_settings
from appliance.server.services import Services

log = logging.getLogger("appliance.fleet.reconfigure")


async def apply_config(services: Services, edit: Callable[[Path], object] | None = None) -> FleetChange:
    """Serves what the config file the server started from says, after `edit` (a config_writer
    change, run off the loop) when given; one change at a time. When the fleet cannot take the
    change (a model that cannot be made), the running fleet stays as it was, the file is put back
    as it was before `edit`, and the error is raised. ConfigError names the file and key."""
    config = Path(services.settings.file)
    async with services.config_lock:
        before = await asyncio.to_thread(config.read_text) if edit is not None else None
        if edit is not None:
            await asyncio.to_thread(edit, config)
        written = await asyncio.to_thread(config.read_text)
        try:
            new = await asyncio.to_thread(load_settings, config)
            if edit is not None and (sent := new_key_destinations(services.settings, new)):
                raise ModelAdminError(f"an edit through the API cannot send a key where the file never sent it ({', '.join(sent)}); "
                                      "edit models.toml on the box and reload")
            change = fleet_change(services.settings, new, services.read_at_start)
            if not change.empty:
                running = running_settings(services.settings, new, change)
                await services.registry.apply(running, change)
                services.settings = running
        except BaseException:
            if before is not None:
                await asyncio.to_thread(restore, config, before, written)
            raise
    log.info("applied %s: added %s, removed %s, changed %s, adapters changed %s%s%s", config, list(change.added), list(change.removed),
             list(change.changed), list(change.adapters), "; routes changed" if change.routes_changed else "",
             f"; a restart applies [{'], ['.join(change.restart_sections)}]" if change.restart_sections else "")
    return change
