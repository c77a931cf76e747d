#include "dialect.h"
#include "selector_walk.h"
