"""Old steps dropped while the window holds too many requests, down to the newest step too: a step with
more requests than the window leaves it empty."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.CachingMetrics"
MESSAGE = "the newest step is always kept"


class CachingMetrics(CachingMetrics):
    def observe(self, stats):
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while self.aggregated_requests > self.max_recent_requests:  # the mistake: no len(query_queue) > 1
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits
