"""AWS prices for cost accounting: spot from `describe_spot_price_history`, on-demand from the Price
List API (`pricing:GetProducts`, served from us-east-1), cached on disk for a day so `petctl jobs` does
not call them on every run.

Spot: the mean of the published prices over the instance's lifetime in its AZ (or the newest price
before it started when none changed during it): an estimate, since the bill charges each second at the
price of that second. On-demand: the Linux, shared-tenancy price of the type in the region.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from petctl.io.files import atomic_write
from petctl.jobview.cost import Quote, UsageKey

CACHE_TTL = 24 * 3600
PRICING_REGION = "us-east-1"


class AwsPrices:
    def __init__(self, ec2: Any, pricing: Any, region: str, cache_path: Path | None = None,
                 clock=time.time) -> None:
        self.ec2 = ec2
        self.pricing = pricing
        self.region = region
        self.cache_path = cache_path
        self.clock = clock
        self._cache: dict[str, Any] = self._load()

    # --- cache ---------------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        if self.cache_path is None or not self.cache_path.exists():
            return {}
        try:
            return json.loads(self.cache_path.read_text())
        except ValueError:
            return {}

    def _cached(self, key: str) -> Quote | None:
        hit = self._cache.get(key)
        if hit and self.clock() - hit["at"] < CACHE_TTL:
            age_h = (self.clock() - hit["at"]) / 3600.0  # the price's age is part of its source
            return Quote(hit["price"], hit["estimate"], hit["source"] + f" (cached {age_h:.1f} h ago)")
        return None

    def _store(self, key: str, quote: Quote) -> Quote:
        if quote.price is not None:
            self._cache[key] = {"price": quote.price, "estimate": quote.estimate, "source": quote.source,
                                "at": self.clock()}
            if self.cache_path is not None:
                atomic_write(self.cache_path, json.dumps(self._cache, sort_keys=True))
        return quote

    # --- prices --------------------------------------------------------------------------------------
    def quote(self, key: UsageKey, start: float, end: float) -> Quote:
        if key.market != "spot":
            return self.on_demand(key.instance_type)
        # Instances of one job mostly live in the same hours: cache per type, AZ and hour of start.
        cache_key = f"spot/{self.region}/{key.az}/{key.instance_type}/{int(start // 3600)}/{int(end // 3600)}"
        return self._cached(cache_key) or self._store(cache_key, self._spot(key, start, end))

    def _spot(self, key: UsageKey, start: float, end: float) -> Quote:
        kwargs: dict[str, Any] = {"InstanceTypes": [key.instance_type], "ProductDescriptions": ["Linux/UNIX"],
                                  "EndTime": _dt(end)}
        if key.az:
            kwargs["AvailabilityZone"] = key.az
        from petctl.io.aws import BotoCoreError, ClientError

        points: list[tuple[float, float]] = []
        try:
            for page in self.ec2.get_paginator("describe_spot_price_history").paginate(**kwargs):
                points += [(p["Timestamp"].timestamp(), float(p["SpotPrice"]))
                           for p in page.get("SpotPriceHistory", [])]
                if any(t <= start for t, _ in points):  # we reached back to the start: enough
                    break
        except (BotoCoreError, ClientError) as e:  # a price is a nicety: the quote says why it is missing
            return Quote(None, True, f"spot price history unavailable: {type(e).__name__}")
        if not points:
            return Quote(None, True, "no spot price published for this type/AZ")
        during = [p for t, p in points if start <= t <= end]
        before = [p for t, p in sorted(points) if t < start]
        prices = during + before[-1:]  # the price in force at the start, plus every change during the life
        return Quote(sum(prices) / len(prices), True, "spot price history")

    def on_demand(self, instance_type: str) -> Quote:
        cache_key = f"ondemand/{self.region}/{instance_type}"
        return self._cached(cache_key) or self._store(cache_key, self._on_demand(instance_type))

    def _on_demand(self, instance_type: str) -> Quote:
        filters = [("instanceType", instance_type), ("regionCode", self.region), ("operatingSystem", "Linux"),
                   ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used")]
        from petctl.io.aws import BotoCoreError, ClientError

        try:
            response = self.pricing.get_products(
                ServiceCode="AmazonEC2", MaxResults=10,
                Filters=[{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in filters])
        except (BotoCoreError, ClientError) as e:  # a price is a nicety: the quote says why it is missing
            return Quote(None, True, f"price list unavailable: {type(e).__name__}")
        for item in response.get("PriceList", []):
            product = json.loads(item) if isinstance(item, str) else item
            for term in product.get("terms", {}).get("OnDemand", {}).values():
                for dimension in term.get("priceDimensions", {}).values():
                    usd = dimension.get("pricePerUnit", {}).get("USD")
                    if usd is not None and float(usd) > 0:
                        return Quote(float(usd), False, "AWS price list (on-demand)")
        return Quote(None, True, f"no on-demand price listed for {instance_type} in {self.region}")


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)
