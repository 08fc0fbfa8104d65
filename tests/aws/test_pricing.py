"""AWS prices: spot price history against moto (a real server on loopback), the Price List API through
a client-level fixture (moto lacks it; see fixtures/README.md), and the one-day cache."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
from botocore.stub import Stubber

from petctl.jobview.cost import UsageKey
from petctl.providers.aws.pricing import AwsPrices
from tests.support.aws.account import REGION, boto

FIXTURES = Path(__file__).parent / "fixtures"


def pricing_client(responses: int):
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    stub = Stubber(client)
    body = json.loads((FIXTURES / "get_products_g5_xlarge.json").read_text())
    for _ in range(responses):
        stub.add_response("get_products", body)
    stub.activate()
    return client, stub


def test_spot_price_from_history_against_moto(moto):
    prices = AwsPrices(boto(moto, "ec2"), None, REGION)
    quote = prices.quote(UsageKey("g5.xlarge", "spot", f"{REGION}a"), 1.79e9, 1.79e9 + 3600)
    # moto publishes one (placeholder) price, long before the instance's life: the price in force.
    assert quote.price == 0.00001 and quote.estimate and quote.source == "spot price history"


def test_on_demand_price_from_the_price_list():
    client, stub = pricing_client(1)
    quote = AwsPrices(None, client, "us-east-1").on_demand("g5.xlarge")
    assert quote.price == 1.006 and not quote.estimate
    stub.assert_no_pending_responses()


def test_prices_are_cached_for_a_day(tmp_path):
    cache = tmp_path / "prices.json"
    now = [1.8e9]
    client, stub = pricing_client(2)
    AwsPrices(None, client, "us-east-1", cache, clock=lambda: now[0]).on_demand("g5.xlarge")
    again = AwsPrices(None, client, "us-east-1", cache, clock=lambda: now[0] + 3600).on_demand("g5.xlarge")
    assert again.price == 1.006 and "cached" in again.source
    assert len(stub._queue) == 1  # the second lookup never reached the API
    now[0] += 2 * 24 * 3600
    fresh = AwsPrices(None, client, "us-east-1", cache, clock=lambda: now[0]).on_demand("g5.xlarge")
    assert fresh.price == 1.006 and "cached" not in fresh.source
    stub.assert_no_pending_responses()


def test_price_list_failure_is_an_unknown_price_not_an_error():
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    stub = Stubber(client)
    stub.add_client_error("get_products", service_error_code="AccessDeniedException", http_status_code=403)
    stub.activate()
    quote = AwsPrices(None, client, "us-east-1").on_demand("g5.xlarge")
    assert quote.price is None and "unavailable" in quote.source
