"""A resumed request's lookups added to the first ones: the requests resumed after a preemption find
their own blocks again and lift the hit rate."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.CachingMetrics"
MESSAGE = "a resumed request's lookup does not count"


class CachingMetrics(CachingMetrics):
    def observe(self, stats):
        requests = stats.requests + stats.preempted_requests  # the mistake: the preempted_ counts too
        queries = stats.queries + stats.preempted_queries
        hits = stats.hits + stats.preempted_hits
        if requests == 0:
            return
        self.query_queue.append((requests, queries, hits))
        self.aggregated_requests += requests
        self.aggregated_query_total += queries
        self.aggregated_query_hit += hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits
