"""The slot fillers shared by the distillation traffic's phrase banks (distill_classification.py,
distill_extraction.py): people, places, products, teams and companies, plus dates and numbers
written the several ways people write them.

Every name here was made up for this project (the cities are real places, the people, teams and
companies are not), and none was taken from the workload's hand-written items.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

FIRST = ["Priya", "Tomasz", "Ingrid", "Kwame", "Lucía", "Dmitri", "Aoife", "Hamid", "Marisol", "Bjorn", "Keiko",
         "Olufemi", "Rosalind", "Teodor", "Yasmin", "Callum", "Annika", "Rafael", "Noor", "Elspeth", "Jun", "Beatriz",
         "Oskar", "Zainab", "Pieter", "Mireille", "Desmond", "Leilani", "Anselm", "Farah", "Gideon", "Saoirse",
         "Matteo", "Ximena", "Lorcan", "Hedda", "Emeka", "Wilhelmina", "Tariq", "Solveig"]
LAST = ["Okafor", "Lindqvist", "Barros", "Hallworth", "Nakamura", "Pereira", "Quigley", "Abernathy", "Achterberg",
        "Delacroix", "Mwangi", "Fenwick", "Sorensen", "Castellano", "Iwu", "Brannigan", "Holloway", "Kowalczyk",
        "Ferreira", "Thorne", "Ogunleye", "Marchetti", "Haugen", "Pemberton", "Yilmaz", "Dunmore", "Rasmussen",
        "Esposito", "Carrick", "Bhattacharya", "Lefebvre", "Kaminski", "Oyelaran", "Strand", "Galloway",
        "Mendonça", "Whitcombe", "Novak", "Arbuthnot", "Szabo"]
# (city, state or province, country): addresses need all three, prose only the city.
US_CITIES = [("Tucson", "AZ"), ("Boise", "ID"), ("Albany", "NY"), ("Savannah", "GA"), ("Duluth", "MN"),
             ("Spokane", "WA"), ("Asheville", "NC"), ("Madison", "WI"), ("Eugene", "OR"), ("Chattanooga", "TN"),
             ("Lexington", "KY"), ("Santa Fe", "NM"), ("Burlington", "VT"), ("Fort Collins", "CO"), ("Wichita", "KS"),
             ("Des Moines", "IA"), ("Baton Rouge", "LA"), ("Provo", "UT"), ("Ann Arbor", "MI"), ("Bangor", "ME")]
CA_CITIES = [("Halifax", "NS"), ("Kelowna", "BC"), ("Saskatoon", "SK"), ("Kingston", "ON"), ("Victoria", "BC"),
             ("Moncton", "NB"), ("Lethbridge", "AB"), ("Sherbrooke", "QC"), ("Thunder Bay", "ON"), ("Charlottetown", "PE")]
WORLD_CITIES = ["Ghent", "Porto", "Tampere", "Ljubljana", "Gdańsk", "Bergen", "Valencia", "Cork", "Lyon", "Aarhus",
                "Bologna", "Graz", "Kraków", "Utrecht", "Leipzig", "Bilbao", "Galway", "Malmö"]
CITIES = [c for c, _ in US_CITIES] + [c for c, _ in CA_CITIES] + WORLD_CITIES
STREETS = ["Alder Court", "Quarry Road", "Linden Avenue", "Foundry Lane", "Maple Terrace", "Heron Way",
           "Orchard Street", "Canal Row", "Juniper Drive", "Tannery Close", "Willow Bend", "Sextant Place"]
# All start with a consonant sound: the templates say "a {product}".
PRODUCTS = ["desk lamp", "bath towel set", "coffee grinder", "bookshelf", "duvet cover", "cast-iron skillet",
            "standing fan", "kettle", "swivel chair", "wool rug", "blender", "curtain set", "wall mirror", "toaster",
            "side table", "knife block", "HEPA purifier", "laundry basket", "memory foam pillow", "wall clock",
            "spice rack", "shoe cabinet", "dish rack", "floor lamp"]
COLOURS = ["navy", "sage green", "charcoal", "mustard", "ivory", "terracotta", "slate blue", "oatmeal"]
TEAMS = ["Harbor City Gulls", "Millbrook Rangers", "Eastvale Foxes", "Redcliff United", "Port Alder Mariners",
         "Stonebridge Athletic", "Cedar Hollow Hawks", "Westmarch Wanderers", "Larkfield Lions", "Northgate Comets",
         "Brackenridge Bears", "Saltmarsh Rovers", "Kingsferry Kestrels", "Ashby Vale Thunder"]
COMPANIES = ["Northwind Freight", "Larkspur Foods", "Brightmoor Motors", "Calloway Pharma", "Tidewater Energy",
             "Quillon Software", "Ambergate Retail", "Fernhill Textiles", "Pinecrest Airlines", "Halden Steel",
             "Moorgate Telecom", "Silverline Bank", "Greystone Mining", "Juniper Logistics", "Copperleaf Media"]
TOPICS = ["the new bike lanes", "the library renovation", "the harbour clean-up", "the school lunch programme",
          "the night market", "the tram extension", "the community garden", "the old mill conversion",
          "the river festival", "the park bench appeal", "the youth orchestra", "the bus timetable changes",
          "the flood barrier works", "the museum's late openings", "the allotment waiting list",
          "the town hall repairs", "the street food fair", "the rescue shelter's open day",
          "the swimming pool reopening", "the volunteer fire brigade"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
MONTH_SHORT = ["Jan.", "Feb.", "Mar.", "Apr.", "May", "June", "July", "Aug.", "Sept.", "Oct.", "Nov.", "Dec."]

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def spoken(n: int) -> str:
    """An integer below a million in English words: 3420 is 'three thousand four hundred twenty'."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"{n} is out of range")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + spoken(n % 100))
    return spoken(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + spoken(n % 1000))


def count_text(rng: random.Random, n: int) -> str:
    """A head count as people write it: 3,420, 3420, or in words when it is short enough to say."""
    forms = [f"{n:,}", str(n)]
    if n < 10_000 and (n % 10 == 0 or n < 100):
        forms.append(spoken(n))
    return rng.choice(forms)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def random_date(rng: random.Random, first: int = 2024, last: int = 2027) -> dt.date:
    start = dt.date(first, 1, 1)
    return start + dt.timedelta(days=rng.randrange((dt.date(last, 12, 31) - start).days + 1))


def date_text(rng: random.Random, d: dt.date) -> str:
    """A full date (year included, so it resolves to one YYYY-MM-DD) in one of the ways it gets written."""
    month, short, weekday = MONTHS[d.month - 1], MONTH_SHORT[d.month - 1], WEEKDAYS[d.weekday()]
    return rng.choice([
        f"{month} {d.day}, {d.year}", f"{d.day} {month} {d.year}", d.isoformat(), f"{weekday}, {month} {d.day}, {d.year}",
        f"the {ordinal(d.day)} of {month} {d.year}", f"{short} {d.day}, {d.year}", f"{d.day} {short.rstrip('.')} {d.year}",
        f"{month} {ordinal(d.day)}, {d.year}", f"{weekday} {d.day} {month} {d.year}",
    ])


def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


Filler = list[str] | Callable[[random.Random], str]
SLOTS: dict[str, Filler] = {
    "name": person, "first": FIRST, "surname": LAST, "city": CITIES, "us_city": [c for c, _ in US_CITIES],
    "street": STREETS, "product": PRODUCTS, "colour": COLOURS, "team": TEAMS, "company": COMPANIES, "topic": TOPICS,
    "weekday": WEEKDAYS, "month": MONTHS,
    "order": lambda rng: f"A-{rng.randint(20000, 99999)}",
    "amount": lambda rng: f"${rng.randint(8, 640)}.{rng.choice(['00', '49', '99', '95', '20'])}",
    "days": lambda rng: rng.choice(["three", "four", "five", "six", "eight", "ten", "twelve"]),
}
_SLOT = re.compile(r"\{([a-z_]+?)(\d?)\}")


def fill(template: str, rng: random.Random, fixed: Mapping[str, Any] | None = None,
         slots: Mapping[str, Filler] | None = None) -> str:
    """The template with each {slot} replaced: from `fixed` when named there, else drawn from
    `slots` (then SLOTS). A slot keeps its value wherever it recurs; {team2} draws a team other
    than {team}'s."""
    fixed = dict(fixed or {})
    banks = {**SLOTS, **(slots or {})}
    chosen: dict[str, str] = {}

    def value(match: re.Match[str]) -> str:
        key, base = match.group(1) + match.group(2), match.group(1)
        if key in fixed:
            return str(fixed[key])
        if key not in chosen:
            bank = banks[base]
            taken = {str(v) for k, v in [*fixed.items(), *chosen.items()] if k.rstrip("0123456789") == base}
            for _ in range(50):  # a different value from the slot's other copies ({team} vs {team2})
                pick = bank(rng) if callable(bank) else rng.choice(bank)
                if pick not in taken:
                    break
            chosen[key] = pick
        return chosen[key]

    return _SLOT.sub(value, template)
