"""`appliance keys` and `appliance budgets`: who may call, and what they may spend. Both work on the
data directory's database directly, so they need no running server."""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from appliance.cli.exits import FAILED, USAGE, CommandError
from appliance.cli.support import config_in_use, data_dir, ledger_db, ledger_of, moment, print_rows, when
from policy.budgets import GLOBAL_NAME, LEVELS, PERIODS, dollars, nanos_from_usd, usd

SPENDER_LEVELS = ("user", "tenant", "app")


def parse_expiry(text: str, now: float) -> float:
    """'30d', '12h', '45m', '90s' from now, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    return moment(text, now, 1, "--expires")


def cmd_keys_create(args: argparse.Namespace) -> int:
    from appliance.store.db import database_path
    from appliance.store.keys import KeyStore

    now = time.time()
    try:
        expires = parse_expiry(args.expires, now) if args.expires else None
        settings = config_in_use(args.config)
        with closing(ledger_of(settings)) as db:
            record, secret = KeyStore(db).create(
                user=args.user, tenant=args.tenant, app=args.app, role=args.role, admin=args.admin, now=now, expires_at=expires)
    except ValueError as exc:
        raise CommandError(str(exc), USAGE) from None
    print(f"created {'admin ' if record.admin else ''}key {record.id} for user {record.user}, tenant {record.tenant}, "
          f"app {record.app}, role {record.role}" + (f", expires {args.expires}" if expires else ""))
    # A key written to another data directory than the server's is a key that server never sees.
    print(f"stored in {database_path(data_dir(settings))}" + (f" (the data directory of {settings.file})" if settings else
                                                               " (no config file found: the default data directory)"))
    if settings is not None and settings.auth.mode == "open":
        print(f"warning: {settings.file} has [auth] mode = \"open\": a server started with it checks no keys, so this key "
              "is not asked for until mode = \"keys\"", file=sys.stderr)
    print("the secret is shown once; store it now:")
    print(secret)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from appliance.store.keys import KeyStore, LastAdminKey

    last = False
    with closing(ledger_db(args.config)) as db:
        store, now = KeyStore(db), time.time()
        try:
            revoked = store.revoke(args.id, now)
        except LastAdminKey:  # the admin API refuses this one; on the machine it is the operator's call
            last, revoked = True, store.revoke(args.id, now, keep_an_admin=False)
    if not revoked:
        raise CommandError(f"there is no active key {args.id}", FAILED)
    print(f"revoked {args.id} (a running server stops accepting it within its key cache time)")
    if last:
        print(f"warning: {args.id} was the last active admin key: /admin/* and the TUI refuse every key until "
              "`appliance keys create --admin` makes another", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from appliance.store.keys import KeyStore

    with closing(ledger_db(args.config)) as db:
        records = KeyStore(db).all()
    if args.json:
        print(json.dumps({"keys": [{"id": r.id, "user": r.user, "tenant": r.tenant, "app": r.app, "role": r.role, "admin": r.admin,
                                    "created_at": when(r.created_at), "expires_at": _iso(r.expires_at), "revoked_at": _iso(r.revoked_at)}
                                   for r in records]}, indent=2))
        return 0
    print_rows(("id", "user", "tenant", "app", "role", "admin", "expires_at", "revoked_at"), [
        (r.id, r.user, r.tenant, r.app, r.role, "yes" if r.admin else "no", when(r.expires_at), when(r.revoked_at)) for r in records
    ])
    return 0


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else when(epoch)


def level_name(args: argparse.Namespace) -> str:
    """The name the ledger keeps a level's budget under; a usage error for a global budget given a
    name (it would be ignored) or another level given none."""
    if args.level == "global":
        if args.name:
            raise CommandError(f"a global budget takes no name: leave out {args.name!r} "
                               f"(`appliance budgets {args.budgets_command} global ...`)", USAGE)
        return GLOBAL_NAME
    if not args.name:
        raise CommandError(f"a {args.level} budget needs the {args.level}'s name", USAGE)
    return str(args.name)


def _known_names(db: Any, settings: Any, level: str) -> set[str]:
    """The names of `level` a request can carry: every key's (revoked ones too: not a typo), and
    the open principal's when the config lets requests in without a key."""
    from appliance.store.keys import KeyStore

    names = {getattr(r, level) for r in KeyStore(db).all()}
    if settings is not None and settings.auth.mode == "open":
        names.add(getattr(settings.auth.open_principal, level))
    return names


def cmd_budgets_set(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger, LedgerError

    name = level_name(args)
    if not args.usd >= 0:
        raise CommandError("--usd must be zero or more", USAGE)
    settings = config_in_use(args.config)
    with closing(ledger_of(settings)) as db:
        try:
            Ledger(db).set_limit(args.level, name, nanos_from_usd(args.usd), args.period, time.time())
        except LedgerError as exc:
            raise CommandError(str(exc), USAGE) from None
        known = _known_names(db, settings, args.level) if args.level != "global" else {name}
    print(f"{args.level} {name}: {dollars(nanos_from_usd(args.usd))} per {args.period}")
    if name not in known:  # a misspelt name is a budget nobody is ever charged against
        have = (f"the {args.level}s known: " + ", ".join(sorted(known)[:10]) + (", ..." if len(known) > 10 else "")) if known else "there are no keys yet"
        print(f"warning: no key has {args.level} {name!r} ({have}); the budget is set all the same, and binds once a key "
              f"with that {args.level} calls", file=sys.stderr)
    return 0


def cmd_budgets_unset(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger

    name = level_name(args)
    with closing(ledger_db(args.config)) as db:
        removed = Ledger(db).remove_limit(args.level, name)
    if not removed:
        raise CommandError(f"there is no budget for {args.level} {name}", FAILED)
    print(f"removed the budget of {args.level} {name} (spend is still recorded)")
    return 0


def cmd_budgets_reset(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger

    name = level_name(args)
    with closing(ledger_db(args.config)) as db:
        written_off = Ledger(db).reset_spend(args.level, name, args.period, time.time())
    print(f"{args.level} {name}: wrote off {dollars(written_off)} of this {args.period}'s spend")
    return 0


def spenders(ledger: Any, now: float) -> dict[str, dict[str, list[tuple[str, int]]]]:
    """Each level's top spenders in the current day and month, limited or not: {period: {level: [(name, nanos)]}}."""
    return {period: {level: ledger.top_spenders(level, period, now) for level in SPENDER_LEVELS} for period in ("day", "month")}


def cmd_budgets_show(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger

    now = time.time()
    with closing(ledger_db(args.config)) as db:
        ledger = Ledger(db)
        budgets, reservations = ledger.budgets(now), ledger.reservations()
        top = spenders(ledger, now)
        problems = ledger.imbalances()
    if args.json:
        listed = {f"top_spenders_{'today' if period == 'day' else 'month'}":
                  {level: [{"name": n, "spent_usd": usd(s)} for n, s in rows] for level, rows in levels.items()}
                  for period, levels in top.items()}
        print(json.dumps({
            "budgets": [{"level": b.level, "name": b.name, "period": b.period, "window": b.window, "limit_usd": usd(b.limit_nanos),
                         "spent_usd": usd(b.spent_nanos), "held_usd": usd(b.held_nanos),
                         "remaining_usd": usd(max(0, b.limit_nanos - b.spent_nanos - b.held_nanos))} for b in budgets],
            "reservations": reservations, **listed, "balanced": not problems,
        }, indent=2))
        return 0
    print_rows(("level", "name", "period", "limit", "spent", "held", "remaining"), [
        (b.level, b.name, b.period, dollars(b.limit_nanos), dollars(b.spent_nanos), dollars(b.held_nanos),
         dollars(max(0, b.limit_nanos - b.spent_nanos - b.held_nanos))) for b in budgets
    ])
    print(f"reservations in flight: {len(reservations)}; ledger {'balanced' if not problems else 'NOT balanced: ' + '; '.join(problems)}")
    rows = []
    for level in SPENDER_LEVELS:
        today, month = dict(top["day"][level]), dict(top["month"][level])
        for name in sorted(today.keys() | month.keys(), key=lambda n: (-month.get(n, 0), n)):
            rows.append((level, name, dollars(today.get(name, 0)), dollars(month.get(name, 0))))
    if rows:
        print("\ntop spenders, with a budget or without:")
        print_rows(("level", "name", "today", "this_month"), rows)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key; the secret is printed once, alone on the last line")
    create.add_argument("--tenant", required=True, help="the tenant its calls are charged to")
    create.add_argument("--app", required=True, help="the app its calls are charged to")
    create.add_argument("--user", required=True, help="the user its calls are charged to")
    create.add_argument("--role", required=True, help="the caller's role: a route's role_floor and role_ceiling bound its tiers by it; cached answers are kept per tenant and role")
    create.add_argument("--admin", action="store_true", help="may call the admin API")
    create.add_argument("--expires", help="a duration (30d, 12h, 45m, 90s) or an ISO 8601 date (default: never)")
    create.add_argument("--config", type=Path)
    create.set_defaults(func=cmd_keys_create)
    revoke = keys.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("id", help="the key's id (key_...), as `appliance keys list` shows it")
    revoke.add_argument("--config", type=Path)
    revoke.set_defaults(func=cmd_keys_revoke)
    klist = keys.add_parser("list", help="list keys (never their secrets)")
    klist.add_argument("--json", action="store_true")
    klist.add_argument("--config", type=Path)
    klist.set_defaults(func=cmd_keys_list)

    budgets = sub.add_parser("budgets", help="dollar budgets per user, tenant, app or globally").add_subparsers(dest="budgets_command", required=True)
    name_help = "the user, tenant or app (none for global)"
    bset = budgets.add_parser("set", help="set a level's budget")
    bset.add_argument("level", choices=LEVELS)
    bset.add_argument("name", nargs="?", help=name_help)
    bset.add_argument("--usd", type=float, required=True, help="the limit in dollars per period (0 refuses every priced call)")
    bset.add_argument("--period", choices=PERIODS, required=True, help="the window the limit applies to (UTC days and months)")
    bset.add_argument("--config", type=Path)
    bset.set_defaults(func=cmd_budgets_set)
    bunset = budgets.add_parser("unset", help="remove a level's budget (its spend stays recorded)")
    bunset.add_argument("level", choices=LEVELS)
    bunset.add_argument("name", nargs="?", help=name_help)
    bunset.add_argument("--config", type=Path)
    bunset.set_defaults(func=cmd_budgets_unset)
    breset = budgets.add_parser("reset", help="write off a level's spend in the current window")
    breset.add_argument("level", choices=LEVELS)
    breset.add_argument("name", nargs="?", help=name_help)
    breset.add_argument("--period", choices=PERIODS, required=True, help="the window whose spend to write off")
    breset.add_argument("--config", type=Path)
    breset.set_defaults(func=cmd_budgets_reset)
    bshow = budgets.add_parser("show", help="budgets, spend, reservations in flight, top spenders")
    bshow.add_argument("--json", action="store_true")
    bshow.add_argument("--config", type=Path)
    bshow.set_defaults(func=cmd_budgets_show)
