import pytest

from pdserve.errors import ConfigError
from pdserve.slo import SLO, Condition, Metric


def test_parse_named_slo():
    slo = SLO.parse("blog:ttft<1000,mean_itl<50")
    assert slo.name == "blog"
    assert slo.conditions == (Condition(Metric.TTFT, 1000.0), Condition(Metric.MEAN_ITL, 50.0))
    assert slo.limit(Metric.MAX_GAP) is None
    assert SLO.parse(str(slo)) == slo


def test_parse_unnamed_slo_is_named_by_its_spec():
    slo = SLO.parse(" ttft < 800ms , max_gap<200 ")
    assert slo.name == "ttft < 800ms , max_gap<200"
    assert slo.spec == "ttft<800,max_gap<200"


@pytest.mark.parametrize(
    "text", ["", "x:", "ttft>5", "ttft<abc", "p99<3", "ttft<0", "ttft<1,ttft<2", "ttft<-1"]
)
def test_parse_rejects_malformed(text):
    with pytest.raises(ConfigError):
        SLO.parse(text)
