"""The window counted in steps, not requests: max_recent_requests steps are kept, however many requests
each one looked up."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.CachingMetrics"
MESSAGE = "the window holds the most recent max_recent_requests requests, not steps"


class CachingMetrics(CachingMetrics):
    def observe(self, stats):
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > self.max_recent_requests:  # the mistake: steps, not requests
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits
